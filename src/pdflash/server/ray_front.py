"""The front of `pdflash serve --replicas N`: one HTTP/websocket server forwarding to engine replicas.

Owns what the replicas cannot answer alone: `/health` (503 while no replica is ready) and
`/metrics` (every replica's series, labelled `replica`), forwarding everything else — each
HTTP request whole to one replica, each websocket to one replica for its lifetime —, a
replica's failure mid-response (an SSE stream ends with an `error` event and `[DONE]`, a
socket with an `error` message and close code 1011), and draining on shutdown. Every
response carries `x-pdflash-replica`: the replica that served it (on /health and /metrics,
those that answered). Must not parse or answer the API itself: the replicas run the same
app as `pdflash serve` does in one process (server/replica.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import anyio
import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdflash.server.auth import AccessMiddleware
from pdflash.server.errors import SERVER_ERROR, APIError
from pdflash.server.limits import loads, off_loop, read_body
from pdflash.server.prompts import shutting_down
from pdflash.server.replica import DRAINED, REPLICA_HEADER, portable_scope
from pdflash.server.replica import Route as ReplicaRoute
from pdflash.server.shutdown import Streams
from pdflash.server.sse import DONE, event, unless_disconnected
from pdflash.server.state import ServerSettings

log = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
BROADCAST_TIMEOUT_S = 5.0  # /health and /metrics wait this long for the replicas' answers
REPLICA_FAILED = "replica_failed"
INTERNAL_ERROR_CLOSE = 1011  # websocket close code: the server failed


class ReplicaSet:
    """The replicas as the front sees them: calls through a Ray Serve deployment handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle  # a DeploymentHandle of the EngineReplica deployment
        self.streaming = handle.options(stream=True)

    def stream(self, method: str, *args: Any, route: ReplicaRoute = None) -> Any:
        """A DeploymentResponseGenerator over what `method` yields (async iterable, `.cancel()`)."""
        return getattr(self.streaming, method).remote(*args, route=route)

    async def call(self, method: str, *args: Any, route: ReplicaRoute = None) -> Any:
        return await getattr(self.handle, method).remote(*args, route=route)

    async def broadcast(self, method: str, *args: Any, timeout_s: float = BROADCAST_TIMEOUT_S) -> list[Any]:
        """What every running replica answers to `method` (those that fail or time out are left out)."""
        try:
            async with asyncio.timeout(timeout_s):
                answers = await self.handle.broadcast(method, *args).results_async(return_exceptions=True)
        except Exception as error:  # no replica yet (the router is not populated), or all too slow
            log.debug("broadcast %s: %r", method, error)
            return []
        return [a for a in answers if not isinstance(a, BaseException)]


class FrontStreams(Streams):
    """The front's forwarded responses; draining aborts the live requests on every replica."""

    async def drain(self, engine: Any, timeout_s: float) -> bool:
        self.draining = True
        await engine.broadcast("drain", timeout_s, timeout_s=timeout_s)
        with anyio.move_on_after(timeout_s):
            await self._idle.wait()
            return True
        return False


@attrs.define(eq=False)
class FrontState:
    """What GracefulServer and server_config read from `app.state.pdflash` (`engine`: who drains)."""

    engine: ReplicaSet
    settings: ServerSettings
    streams: FrontStreams = attrs.Factory(FrontStreams)


class ReplicaFront:
    """The ASGI app of the front: `/health` and `/metrics` here, everything else forwarded."""

    def __init__(self, replicas: ReplicaSet, settings: ServerSettings, session_field: str | None = None) -> None:
        self.replicas, self.settings, self.session_field = replicas, settings, session_field
        self.front = FrontState(engine=replicas, settings=settings)
        self.state = SimpleNamespace(pdflash=self.front)  # as create_app's app.state.pdflash
        self.ids = itertools.count()
        self.own = Starlette(
            routes=[Route("/health", self.health, methods=["GET"]), Route("/metrics", self.metrics, methods=["GET"])],
            middleware=[
                Middleware(AccessMiddleware, api_key=settings.api_key, allowed_origins=settings.allowed_origins)
            ],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # none here: the replicas' lifecycle is ray_launch's, around the server
            return
        if scope["type"] == "websocket":
            await self.forward_websocket(scope, receive, send)
        elif scope["path"] in ("/health", "/metrics"):
            await self.own(scope, receive, send)
        else:
            await self.forward_http(scope, receive, send)

    # -- the front's own endpoints ----------------------------------------------------------

    async def health(self, request: Request) -> Response:
        answers = await self.replicas.broadcast("health")
        ready = [a for a in answers if a["running"]]
        body = {
            "status": "ok" if ready else "error",
            "model": self.settings.model_name,
            "ready_replicas": len(ready),
            "replicas": sorted(answers, key=lambda a: a["replica"]),
            "live_sequences": sum(a["live"] for a in answers),
            "waiting": sum(a["waiting"] for a in answers),
        }
        return JSONResponse(
            body, status_code=200 if ready else 503, headers=_replica_header(a["replica"] for a in ready)
        )

    async def metrics(self, request: Request) -> Response:
        parts = sorted(await self.replicas.broadcast("metrics"))
        return Response(
            labelled_exposition(parts), media_type=PROMETHEUS_TEXT, headers=_replica_header(rid for rid, _ in parts)
        )

    # -- forwarding -------------------------------------------------------------------------

    async def forward_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.front.streams.draining:
                raise shutting_down()
            body = await read_body(Request(scope, receive), self.settings.limits.max_body_bytes)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        route = await self._route(scope, body)
        name = f"front-{next(self.ids)}"
        self.front.streams.open(name)
        relay = _Relay(send)
        messages = self.replicas.stream("http", portable_scope(scope), body, route=route)
        try:
            await unless_disconnected(receive, lambda: relay.pump(messages))
        except Exception as error:  # the replica died (or Ray lost it) before the response ended
            log.error("%s %s: the replica failed: %r", scope["method"], scope["path"], error)
            await relay.fail(error)
        finally:
            if not relay.exhausted:  # the client left (or this task was cancelled): the replica's app sees it leave
                _cancel(messages)
            self.front.streams.close(name)

    async def _route(self, scope: Scope, body: bytes) -> ReplicaRoute:
        """("session", key) when `--session-field` names a field this JSON body has; else Ray's default."""
        if self.session_field is None or scope["method"] != "POST":
            return None
        try:
            decoded = await off_loop(len(body), lambda: loads(body, self.settings.limits.max_json_depth))
        except APIError:  # not JSON: the replica answers the 400
            return None
        value = decoded.get(self.session_field) if isinstance(decoded, dict) else None
        return ("session", str(value)) if isinstance(value, (str, int)) and not isinstance(value, bool) else None

    async def forward_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One socket, one replica: its messages go to the replica that accepted it (a pinned route)."""
        key = uuid.uuid4().hex
        await receive()  # websocket.connect: the replica's app answers it (accept, or close)
        messages = self.replicas.stream("ws", key, portable_scope(scope))
        accepted = closed = False
        self.front.streams.open(key)  # on shutdown, owed what its replica sends before DRAINED
        try:
            hello = await messages.__anext__()  # {"type": "pdflash.replica", "replica": id}
            route: ReplicaRoute = ("replica", hello["replica"])
            async with anyio.create_task_group() as tasks:

                async def upstream() -> None:
                    while True:
                        message = await receive()
                        await self.replicas.call("ws_receive", key, message, route=route)
                        if message["type"] == "websocket.disconnect":
                            return

                tasks.start_soon(upstream)
                async for message in messages:
                    if message["type"] == DRAINED:  # every final message before shutdown went out
                        self.front.streams.close(key)
                        continue
                    accepted = accepted or message["type"] == "websocket.accept"
                    await send(message)
                    closed = message["type"] == "websocket.close"
                    if closed:
                        break
                else:
                    closed = True  # the replica's session ended: the client had disconnected
                tasks.cancel_scope.cancel()
        except Exception as error:
            log.error("websocket %s: the replica failed: %r", key, error)
            await _close_failed(send, accepted, error)
        finally:
            self.front.streams.close(key)
            if not closed:
                _cancel(messages)


class _Relay:
    """Sends a replica's ASGI messages on to the client, remembering enough to end the response on failure."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False  # the response's start went out
        self.ended = False  # its last body chunk went out
        self.event_stream = False
        self.exhausted = False  # the replica's stream ended by itself

    async def pump(self, messages: Any) -> None:
        async for message in messages:
            if message["type"] == "http.response.start":
                self.started = True
                media = dict(message.get("headers", ())).get(b"content-type", b"")
                self.event_stream = media.startswith(b"text/event-stream")
            self.ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            await self.send(message)
        self.exhausted = True

    async def fail(self, error: Exception) -> None:
        failure = APIError(
            503, f"the replica serving this request failed: {error}", type=SERVER_ERROR, code=REPLICA_FAILED
        )
        if not self.started:
            response = failure.response()
            await response({"type": "http"}, _no_receive, self.send)
        elif not self.ended:  # a stream: its documented ending; a whole response cannot be repaired
            tail = event(failure.body()) + DONE if self.event_stream else ""
            await self.send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


def _cancel(messages: Any) -> None:
    """Cancel a streaming call; one whose routing or replica already failed has nothing left to cancel."""
    try:
        messages.cancel()
    except Exception as error:  # cancel() re-raises the call's own failure
        log.debug("cancelling a failed call: %r", error)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def _close_failed(send: Send, accepted: bool, error: Exception) -> None:
    if accepted:
        message = {"type": "error", "id": None, "code": REPLICA_FAILED, "param": None}
        message["message"] = f"the replica serving this socket failed: {error}"
        await send({"type": "websocket.send", "text": json.dumps(message)})
    await send({"type": "websocket.close", "code": INTERNAL_ERROR_CLOSE})


def _replica_header(ids: Iterable[str]) -> dict[str, str]:
    return {REPLICA_HEADER.decode(): ",".join(ids) or "none"}


def labelled_exposition(parts: list[tuple[str, bytes]]) -> bytes:
    """One Prometheus exposition of every replica's, each sample labelled with its `replica`."""
    families: dict[str, Metric] = {}
    for replica, text in parts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
