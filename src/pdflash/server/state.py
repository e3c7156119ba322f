"""Server settings and the state every route shares.

Owns the server's own configuration (model name, defaults, websocket limits), validated
once. Must not hold per-request state: that lives in each route's request handling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import attrs

from pdflash.chat.families import FAMILIES
from pdflash.checks import at_least
from pdflash.server.chat import ChatSetup
from pdflash.server.limits import Limits
from pdflash.server.metrics import ServerMetrics, StatsBoard
from pdflash.server.shutdown import Streams


@attrs.frozen(kw_only=True)
class ServerSettings:
    model_name: str = "pdflash"  # the name /v1/models lists and requests must use (or omit)
    default_max_tokens: int = attrs.field(default=256, validator=at_least(1, integer=True))  # when a request gives none
    stats_interval_s: float = attrs.field(
        default=0.5, validator=at_least(0.05, integer=False)
    )  # websocket stats period
    max_ws_generations: int = attrs.field(default=32, validator=at_least(1, integer=True))  # concurrent ones per socket
    chat_template: Path | None = None  # a jinja file replacing the checkpoint's chat template
    chat_parser: str = "auto"  # chat family of the output parser (pdflash.chat.families), or auto
    max_model_len: int | None = attrs.field(default=None)  # prompt + max_tokens at most (None: the model's context)
    limits: Limits = attrs.Factory(Limits)
    api_key: str | None = None  # bearer token every endpoint but /health (and the demo page) requires
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # besides same-origin; "*": any
    sampling_defaults: dict = attrs.Factory(dict)  # SamplingParams fields a request omits (generation_config.json)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name={self.model_name!r} is invalid: it must be a non-empty string")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template={str(self.chat_template)!r} is not a file; give a jinja template's path")
        if self.chat_parser != "auto" and self.chat_parser not in FAMILIES:
            raise ValueError(f"chat_parser={self.chat_parser!r} is invalid; choose auto or one of {sorted(FAMILIES)}")
        if self.max_model_len is not None:
            at_least(2, integer=True)(self, attrs.fields(ServerSettings).max_model_len, self.max_model_len)
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("api_key is invalid: it must be a non-empty string (or None for no key)")


@attrs.define(eq=False)
class ServerState:
    engine: Any  # an AsyncEngine (entered by the app's lifespan)
    settings: ServerSettings
    metrics: ServerMetrics
    board: StatsBoard
    started: int  # unix time the app was created (the model card's `created`)
    chat: ChatSetup  # the chat template and output parser family chat requests use
    max_model_len: int  # the settings' max_model_len, or the model's context
    streams: Streams = attrs.Factory(Streams)

    async def release(self, request_id: str) -> None:
        """Make sure an engine request is gone: abort it if still live, waiting (shielded) for its release.

        A no-op for a finished request. Needed where a stream may never have been iterated:
        closing an async generator that never started runs none of its cleanup.
        """
        with anyio.CancelScope(shield=True):
            await self.engine.abort(request_id)
