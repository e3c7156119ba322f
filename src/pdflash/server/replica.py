"""One engine replica of `pdflash serve --replicas N`: an AsyncEngine and its pdflash app inside a Ray Serve actor.

Owns a replica's life (load, run the engine on the replica's event loop, stop it) and the
ASGI bridge that lets the front (server/ray_front.py) forward whole HTTP requests and
websocket connections to the replica's own `create_app` app, so every surface behaves as in
one process. The front calls `http` and `ws` as streaming calls (each item is one ASGI
message the app sent) and `ws_receive` to deliver a client's websocket message; every
method takes the router's `route` hint (server/replica_router.py) and ignores it. Must not
import Ray at module level (ray_launch decorates the class) nor route requests itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping, MutableMapping
from contextlib import aclosing
from typing import Any

import attrs

from pdflash.server.state import ServerSettings

log = logging.getLogger(__name__)
REPLICA_HEADER = b"x-pdflash-replica"
DRAINED = "pdflash.drained"  # on a socket's stream: the replica's final messages before it went out
SCOPE_KEYS = (  # the picklable parts of an ASGI scope (uvicorn's also holds the app and its state)
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
    "subprotocols",
)
Route = tuple[str, str] | None  # ("replica", id) or ("session", key): read by the router only


def portable_scope(scope: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of an ASGI scope a replica's app needs, without the front's own objects."""
    return {key: scope[key] for key in SCOPE_KEYS if key in scope}


@attrs.frozen(kw_only=True)
class ReplicaSpec:
    """What every replica builds: the engine (AsyncEngine.from_pretrained's arguments) and the app."""

    engine_options: dict[str, Any]  # target, drafter and the keywords of from_pretrained
    settings: ServerSettings
    torch_threads: int = 1  # intra-op threads of the replica's torch (its lanes add their own)


class EngineReplica:
    """The Ray Serve deployment class (ray_launch wraps it with `serve.deployment`)."""

    async def __init__(self, spec: ReplicaSpec) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        import torch
        from ray import serve

        from pdflash.engine.async_engine import AsyncEngine
        from pdflash.server.app import create_app

        torch.set_num_threads(spec.torch_threads)
        self.id = serve.get_replica_context().replica_id.unique_id
        options = dict(spec.engine_options)
        engine = AsyncEngine.from_pretrained(options.pop("target"), options.pop("drafter", None), **options)
        self.app = create_app(engine, spec.settings)
        self.state = self.app.state.pdflash
        self.sockets: dict[str, asyncio.Queue[MutableMapping[str, Any]]] = {}  # websocket key -> the app's inbox
        self.socket_outboxes: dict[str, asyncio.Queue[MutableMapping[str, Any] | None]] = {}  # key -> what it sent
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._runner = asyncio.create_task(self._run(ready))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({self._runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiter.cancel()
            self._runner.result()  # the engine failed to start: raise its error (Ray retries the replica)
        log.info("replica %s: engine running", self.id)

    async def _run(self, ready: asyncio.Event) -> None:
        """The engine lives in this one task: an anyio task group is exited by the task that entered it."""
        async with self.state.engine:
            ready.set()
            await self._stop.wait()

    async def __del__(self) -> None:
        """Ray's graceful replica shutdown: stop the engine (live requests end with "abort")."""
        self._stop.set()
        await asyncio.wait({self._runner}, timeout=30)

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine died is replaced."""
        if not self.state.engine.running:
            raise RuntimeError(f"replica {self.id}: the engine is not running ({self.state.engine.error!r})")

    # -- the front's calls ----------------------------------------------------------------------

    def health(self, route: Route = None) -> dict[str, Any]:
        s = self.state.engine.stats()
        return {
            "replica": self.id,
            "running": self.state.engine.running,
            "live": s.live_sequences,
            "waiting": s.waiting,
        }

    def metrics(self, route: Route = None) -> tuple[str, bytes]:
        """(replica id, the app's Prometheus exposition)."""
        return self.id, self.state.metrics.exposition()

    async def drain(self, timeout_s: float, route: Route = None) -> bool:
        """Shutdown's first step: refuse new work, abort live requests, wait for their final messages.

        Then every socket's stream gets a DRAINED marker behind those final messages, so the
        front knows when it has relayed all of them (it waits for that before closing sockets).
        """
        drained = await self.state.streams.drain(self.state.engine, timeout_s)
        for outbox in self.socket_outboxes.values():
            outbox.put_nowait({"type": DRAINED})
        return drained

    async def http(
        self, scope: dict[str, Any], body: bytes, route: Route = None
    ) -> AsyncGenerator[MutableMapping[str, Any], None]:
        """Run one HTTP request through the app; yield the ASGI messages it sends.

        If the front cancels this call (its client left), the app sees `http.disconnect`,
        which aborts the engine request as a direct client's leaving does.
        """
        gone = asyncio.Event()
        first = True

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.id.encode())]}
            outbox.put_nowait(message)

        outbox: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        async with aclosing(self._relay(self.app(dict(scope), receive, send), outbox, gone)) as messages:
            async for message in messages:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return

    async def ws(
        self, key: str, scope: dict[str, Any], route: Route = None
    ) -> AsyncGenerator[MutableMapping[str, Any], None]:
        """Run one websocket connection through the app: first `{"type": "pdflash.replica", "replica": id}`,
        then the ASGI messages the app sends. The client's messages arrive through `ws_receive(key, ...)`."""
        inbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        inbox.put_nowait({"type": "websocket.connect"})
        self.sockets[key] = inbox
        gone = asyncio.Event()

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "websocket.accept":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.id.encode())]}
            outbox.put_nowait(message)

        outbox: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        self.socket_outboxes[key] = outbox
        yield {"type": "pdflash.replica", "replica": self.id}
        try:
            async with aclosing(self._relay(self.app(dict(scope), inbox.get, send), outbox, gone)) as messages:
                async for message in messages:
                    yield message
                    if message["type"] == "websocket.close":
                        return
        finally:
            del self.sockets[key], self.socket_outboxes[key]
            if gone.is_set():  # the front left first: end the app's session as a client's disconnect does
                inbox.put_nowait({"type": "websocket.disconnect", "code": 1001})

    def ws_receive(self, key: str, message: dict[str, Any], route: Route = None) -> None:
        inbox = self.sockets.get(key)
        if inbox is None:
            raise LookupError(f"replica {self.id} holds no websocket {key!r} (it ended, or this replica restarted)")
        inbox.put_nowait(message)

    async def _relay(
        self, app_call: Any, outbox: asyncio.Queue[MutableMapping[str, Any] | None], gone: asyncio.Event
    ) -> AsyncGenerator[MutableMapping[str, Any], None]:
        """Run the app call in its own task; yield what it sends until it returns."""
        task = asyncio.ensure_future(app_call)
        task.add_done_callback(lambda _: outbox.put_nowait(None))
        try:
            while (message := await outbox.get()) is not None:
                yield message
            if not task.cancelled() and task.exception() is not None:
                log.error("replica %s: the app raised", self.id, exc_info=task.exception())
        finally:
            if not task.done():
                gone.set()  # the app's next receive() reports the client gone; its cleanup runs in its task
