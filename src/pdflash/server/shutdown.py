"""Graceful shutdown: every live stream ends with its documented final message, then the server exits 0.

Owns what happens between SIGTERM/SIGINT and exit. `Streams` counts the responses whose
final message has not gone out yet (SSE until `[DONE]`, websocket generations until their
`done`/`error`, whole responses until sent). `GracefulServer` (a uvicorn.Server) on a
signal first stops accepting connections, then drains: new requests are refused (503
`shutting_down`), every live engine request is aborted (so its stream ends with
`finish_reason "abort"`), and it waits, bounded, for the final messages to be sent; only
then does uvicorn close the remaining connections and run the lifespan shutdown that stops
the engine. It never re-raises the signal, so the process exits 0. Must not format
messages itself: each surface sends its own final message when its engine stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator
from typing import Any

import anyio
import uvicorn

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 5.0  # how long final messages may take to go out once every request is aborted


class Streams:
    """Engine requests whose client is still owed a final message, and the draining flag."""

    def __init__(self) -> None:
        self.live: set[str] = set()  # request ids
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self, request_id: str) -> None:
        self.live.add(request_id)
        self._idle.clear()

    def close(self, request_id: str) -> None:
        """The final message of `request_id` has been sent (or its client is gone)."""
        self.live.discard(request_id)
        if not self.live:
            self._idle.set()

    async def drain(self, engine: Any, timeout_s: float) -> bool:
        """Refuse new work, abort every live request, wait for the final messages; False on timeout."""
        self.draining = True
        for request_id in list(self.live):
            await engine.abort(request_id)  # its stream ends with finish_reason "abort"
        with anyio.move_on_after(timeout_s):
            await self._idle.wait()
            return True
        return False


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the app's streams before closing connections, and exits 0 on a signal."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting before draining
            server.close()
        state = _app_state(self.config.loaded_app)
        if state is not None and self.started:
            drained = await state.streams.drain(state.engine, self.drain_timeout_s)
            if not drained:
                log.warning(
                    "%d streams had not sent their final message after %.1f s",
                    len(state.streams.live),
                    self.drain_timeout_s,
                )
        for connection in [c for c in self.server_state.connections if _closing_websocket(c)]:
            # its close handshake is under way: uvicorn's shutdown would send a second close
            # frame, which raises (websockets' InvalidState) and fails the exit. It stays in
            # uvicorn's connection set (its own connection_lost removes it, and uvicorn waits
            # for that); only the second close is skipped.
            setattr(connection, "shutdown", _already_closing)  # noqa: B010 (an instance, not its class)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Like uvicorn's, but the captured signal is not raised again afterwards: a requested stop exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _app_state(app: Any) -> Any:
    """The ServerState of a pdflash app, through uvicorn's middleware wrappers (None for another app)."""
    while app is not None:
        state = getattr(getattr(app, "state", None), "pdflash", None)
        if state is not None:
            return state
        app = getattr(app, "app", None)
    return None


def _already_closing() -> None:
    """What a closing websocket does when uvicorn shuts it down: nothing, its close is under way."""


def _closing_websocket(connection: Any) -> bool:
    """A uvicorn websocket connection already closing (or closed); False for anything else."""
    state = getattr(getattr(connection, "conn", None), "state", None)
    return getattr(state, "name", None) in ("CLOSING", "CLOSED")
