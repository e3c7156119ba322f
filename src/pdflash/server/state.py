"""Server settings and the state every route shares.

Owns the server's own configuration (model name, defaults, websocket limits), validated
once. Must not hold per-request state: that lives in each route's request handling.
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs

from pdflash.checks import at_least
from pdflash.server.metrics import ServerMetrics, StatsBoard


@attrs.frozen(kw_only=True)
class ServerSettings:
    model_name: str = "pdflash"  # the name /v1/models lists and requests must use (or omit)
    default_max_tokens: int = attrs.field(default=256, validator=at_least(1, integer=True))  # when a request gives none
    stats_interval_s: float = attrs.field(
        default=0.5, validator=at_least(0.05, integer=False)
    )  # websocket stats period
    max_ws_generations: int = attrs.field(default=32, validator=at_least(1, integer=True))  # concurrent ones per socket

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name={self.model_name!r} is invalid: it must be a non-empty string")


@attrs.define(eq=False)
class ServerState:
    engine: Any  # an AsyncEngine (entered by the app's lifespan)
    settings: ServerSettings
    metrics: ServerMetrics
    board: StatsBoard
    started: int  # unix time the app was created (the model card's `created`)

    async def release(self, request_id: str) -> None:
        """Make sure an engine request is gone: abort it if still live, waiting (shielded) for its release.

        A no-op for a finished request. Needed where a stream may never have been iterated:
        closing an async generator that never started runs none of its cleanup.
        """
        with anyio.CancelScope(shield=True):
            await self.engine.abort(request_id)
