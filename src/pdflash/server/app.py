"""The Starlette app: routes, error handlers, request metrics, and the engine's lifespan.

Owns how the surfaces are wired together: `create_app(engine, settings)` returns an ASGI
app whose lifespan runs the engine (`async with engine`), so the engine lives on the
server's event loop and stops with it. Must not implement a surface itself: each lives
in its own module (completions, websocket, static demo page).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from pdflash.server import protocol
from pdflash.server.auth import AccessMiddleware
from pdflash.server.chat import ChatSetup
from pdflash.server.completions import CompletionRoutes
from pdflash.server.errors import SERVER_ERROR, APIError
from pdflash.server.metrics import ServerMetrics, StatsBoard, endpoint_label
from pdflash.server.state import ServerSettings, ServerState
from pdflash.server.tokenize import TokenizeRoutes
from pdflash.server.websocket import websocket_endpoint

log = logging.getLogger(__name__)
STATIC = resources.files("pdflash.server") / "static"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def create_app(engine: Any, settings: ServerSettings | None = None) -> Starlette:
    """An ASGI app serving `engine` (an AsyncEngine not yet entered; the app's lifespan runs it once)."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine)
    context = engine.speculator.target.config.max_positions
    if settings.max_model_len is not None and settings.max_model_len > context:
        raise ValueError(
            f"max_model_len={settings.max_model_len} is larger than the model's context of {context} tokens"
        )
    state = ServerState(
        engine=engine,
        settings=settings,
        metrics=metrics,
        started=protocol.now(),
        board=StatsBoard(engine, metrics, settings.model_name, settings.stats_interval_s),
        chat=ChatSetup.create(engine.tokenizer, template_file=settings.chat_template, parser=settings.chat_parser),
        max_model_len=settings.max_model_len or context,
    )
    completions = CompletionRoutes(state)
    tokenize = TokenizeRoutes(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    async def index(request: Request) -> Response:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html; charset=utf-8")

    async def health(request: Request) -> Response:
        s = engine.stats()
        body = {
            "status": "ok" if engine.running else "error",
            "model": settings.model_name,
            "live_sequences": s.live_sequences,
            "waiting": s.waiting,
        }
        if engine.error is not None:
            body["error"] = repr(engine.error)
        return JSONResponse(body, status_code=200 if engine.running else 503)

    async def models(request: Request) -> Response:
        card = protocol.model_card(settings.model_name, state.started, state.max_model_len)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:
        protocol.check_model(request.path_params["name"], settings.model_name)
        return JSONResponse(protocol.model_card(settings.model_name, state.started, state.max_model_len))

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_TEXT)

    async def ws(websocket: WebSocket) -> None:
        await websocket_endpoint(state, websocket)

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/chat/completions", completions.chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/version", tokenize.version, methods=["GET"]),
        WebSocketRoute("/ws", ws),
        Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
    ]
    # each handler takes its own exception type; Starlette's annotation says Exception for all
    handlers: dict[Any, Any] = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(RequestMetricsMiddleware, metrics=metrics),
            Middleware(AccessMiddleware, api_key=settings.api_key, allowed_origins=settings.allowed_origins),
        ],
        exception_handlers=handlers,
    )
    app.state.pdflash = state
    return app


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=dict(exc.headers) if exc.headers else None).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {exc!r}", type=SERVER_ERROR).response()


class RequestMetricsMiddleware:
    """Counts HTTP requests by endpoint and the status code they were answered with."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before answering, the error middleware answers 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.requests.labels(endpoint=endpoint_label(scope["path"]), status=str(status)).inc()
