"""Server-sent events, and noticing a client that leaves.

Owns the ASGI side of a streamed response: headers, `data: ...` framing, and a watcher
that cancels the producer when the client disconnects, so an abandoned stream stops its
engine request at once (not at the next token, not when the queue gets to it). Must not
touch the engine: the producer is any async generator; closing it is what aborts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None."""
    result: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await wait_for_disconnect(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await work())
        except Exception as error:  # raised as itself below, not wrapped in the task group's ExceptionGroup
            errors.append(error)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]
    return result[0] if result else None


class EventStreamResponse:
    """An ASGI response streaming `events` (already framed strings) as text/event-stream.

    Headers go out before the first event, so a queued request is visibly accepted. A
    client disconnect cancels the producer; the producer is always closed (aclose) and
    `on_close` always runs, which is what releases whatever it holds.
    """

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close  # runs last, whatever happened (the producer may never have started)
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        try:
            async with aclosing(self.events) as events:
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await unless_disconnected(receive, lambda: self._pump(events, send))
        except OSError:  # the transport broke while sending: the client is gone
            pass
        finally:
            await self.on_close()

    @staticmethod
    async def _pump(events: AsyncGenerator[str, None], send: Send) -> None:
        async for chunk in events:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
