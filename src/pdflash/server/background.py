"""Run an app under uvicorn on a free loopback port in a daemon thread.

Owns starting and stopping such a server (tests, examples, notebooks). Must not be used for
production serving: `pdflash serve` runs uvicorn in the main thread with signal handling.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from pdflash.server.shutdown import GracefulServer


def server_config(app: Any, **options: Any) -> uvicorn.Config:
    """uvicorn settings for a pdflash app: its websocket message limit, lifespan on."""
    state = getattr(getattr(app, "state", None), "pdflash", None)
    if state is not None:
        options.setdefault("ws_max_size", state.settings.limits.max_ws_message_bytes)
    return uvicorn.Config(app, lifespan="on", **options)


class BackgroundServer:
    """`with BackgroundServer(app) as server: requests to server.url ...` (stops on exit)."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.startup_timeout_s = startup_timeout_s
        # uvicorn installs no signal handlers off the main thread; stop() drains like SIGTERM does
        self.config = server_config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = GracefulServer(self.config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/ws"

    def __enter__(self) -> BackgroundServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name=f"uvicorn:{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.url} failed to start (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start within {self.startup_timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
