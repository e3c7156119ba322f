"""Access control: the API key (a bearer token) and the origin allow-list (CORS and websocket Origin).

Owns who may use the server. With `--api-key` every endpoint but `/health` and the demo
page's own files (`/`, `/static/…`: they hold nothing and must load in a browser to ask for
the key) needs `Authorization: Bearer KEY`; a websocket may instead pass `?api_key=KEY` or
send `{"type": "auth", "api_key": KEY}` first. A browser request from another origin — an
`Origin` header that is neither this server's own nor in `--allowed-origins` — is refused
(403) before it reaches a route, websockets included (`Origin: null` too); allowed ones get
CORS headers and preflights. Requests without `Origin` (curl, SDKs) are not browsers and
pass. Must not parse request bodies: limits.py refuses non-JSON content types.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from urllib.parse import parse_qs

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from pdflash.server.errors import APIError

OPEN_PATHS = ("/health", "/", "/favicon.ico")  # reachable without the key (besides /static/)
AUTH_TIMEOUT_S = 10.0  # a websocket must authenticate within this long


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def key_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def bearer(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class AccessMiddleware:
    """Refuses cross-origin browser requests and requests without the API key (when one is set)."""

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_origins: Iterable[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.allowed = frozenset(o.rstrip("/") for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, headers, scope):
            await self._refuse(scope, receive, send, APIError(403, _origin_message(origin), code="origin_not_allowed"))
            return
        cross = origin is not None and not _same_origin(origin, headers, scope)
        if origin is not None and cross and scope["type"] == "http" and scope["method"] == "OPTIONS":
            await _preflight(origin, send)
            return
        path = scope["path"]
        open_path = path in OPEN_PATHS or path.startswith("/static/")
        if (
            scope["type"] == "http"
            and self.api_key is not None
            and not open_path
            and not key_matches(self.api_key, bearer(headers))
        ):
            given = "a wrong API key" if bearer(headers) else "no API key"
            error = unauthorized(f"this server needs an API key: send `Authorization: Bearer KEY` ({given} given)")
            await self._refuse(scope, receive, send, error)
            return
        if origin is not None and cross:
            send = _with_cors(origin, send)
        await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, headers: Headers, scope: Scope) -> bool:
        return "*" in self.allowed or origin.rstrip("/") in self.allowed or _same_origin(origin, headers, scope)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        if scope["type"] == "websocket":  # refused before the handshake completes: the client sees the status
            await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
            return
        await error.response()(scope, receive, send)


def _same_origin(origin: str, headers: Headers, scope: Scope) -> bool:
    """Whether `origin` is this server as the browser addressed it (scheme and Host header)."""
    host = headers.get("host")
    if host is None:
        return False
    secure = scope.get("scheme") in ("https", "wss")
    return origin.rstrip("/") == f"{'https' if secure else 'http'}://{host}"


def _origin_message(origin: str) -> str:
    return f"requests from origin {origin!r} are not allowed; start the server with --allowed-origins {origin}"


async def _preflight(origin: str, send: Send) -> None:
    headers = [
        (b"access-control-allow-origin", origin.encode()),
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", b"authorization, content-type"),
        (b"access-control-max-age", b"600"),
        (b"vary", b"origin"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(origin: str, send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", origin.encode()),
                    (b"vary", b"origin"),
                ],
            }
        await send(message)

    return wrapped


async def websocket_authenticated(api_key: str | None, websocket: WebSocket) -> bool:
    """After accept: True when no key is needed or the socket proved it has it; else it is closed (1008)."""
    if api_key is None:
        return True
    query = parse_qs(websocket.scope.get("query_string", b"").decode(errors="replace"))
    if key_matches(api_key, (query.get("api_key") or [None])[0]) or key_matches(api_key, bearer(websocket.headers)):
        return True
    message = None
    with anyio.move_on_after(AUTH_TIMEOUT_S):
        message = await websocket.receive()
    token = None
    if message is not None and message.get("type") == "websocket.receive" and message.get("text"):
        try:
            first = json.loads(message["text"]) if len(message["text"]) < 4096 else None
        except ValueError:
            first = None
        if isinstance(first, dict) and first.get("type") == "auth" and isinstance(first.get("api_key"), str):
            token = first["api_key"]
    if key_matches(api_key, token):
        return True
    if message is None or message.get("type") != "websocket.disconnect":
        error = {
            "type": "error",
            "id": None,
            "code": "invalid_api_key",
            "param": None,
            "message": 'this server needs an API key: send {"type": "auth", "api_key": KEY} first, '
            "or connect with ?api_key=KEY",
        }
        await websocket.send_text(json.dumps(error))
        await websocket.close(1008)
    return False
