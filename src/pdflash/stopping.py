"""When a request ends: stop tokens, stop strings, the new-token limit and the context limit.

Owns the one decision that a request has ended and why (`StopRule.clip`, applied to every
token a round emits, the prefill's first token included). Stop strings need the text, so a
rule may carry a `StopWatcher` (the request's text stream) that it feeds each emitted token.
Knows nothing of rounds or of how text is streamed.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from pdflash.errors import ContextLimitError
from pdflash.sampling import SamplingParams


class StopWatcher(Protocol):
    """Watches emitted tokens for a stop only their text shows (a stop string)."""

    def push(self, token_id: int) -> bool:
        """Take the next emitted token; True when it completes a stop."""
        ...

    def mark(self) -> object:
        """An opaque state to `rewind` to (a round retried after a failed batch)."""
        ...

    def rewind(self, mark: object) -> None: ...


@attrs.frozen(kw_only=True)
class StopRule:
    stop_ids: frozenset[int]  # finish right after emitting any of these
    max_new_tokens: int  # min(request's max_tokens, room left in the context)
    limited_by_context: bool  # the context, not max_tokens, sets max_new_tokens
    watcher: StopWatcher | None = None  # stop strings, fed every emitted token

    @classmethod
    def for_request(
        cls,
        prompt_len: int,
        params: SamplingParams,
        max_positions: int,
        eos_ids: tuple[int, ...] | frozenset[int] = (),
        watcher: StopWatcher | None = None,
    ) -> StopRule:
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        room = max_positions - prompt_len
        if room < 1:
            raise ContextLimitError(
                f"prompt has {prompt_len} tokens but the model's context limit is {max_positions}; "
                f"at most {max_positions - 1} prompt tokens fit"
            )
        return cls(
            stop_ids=frozenset(params.stop_token_ids) | frozenset(eos_ids),
            max_new_tokens=min(params.max_tokens, room),
            limited_by_context=room < params.max_tokens,
            watcher=watcher,
        )

    def clip(self, emitted: int, new_ids: list[int]) -> tuple[list[int], str | None]:
        """Cut `new_ids` (after `emitted` earlier tokens) where the request ends; say why it ended."""
        for i, token in enumerate(new_ids):
            completes_stop_string = self.watcher is not None and self.watcher.push(token)  # sees every kept token
            if token in self.stop_ids or completes_stop_string:
                return new_ids[: i + 1], "stop"
            if emitted + i + 1 >= self.max_new_tokens:
                return new_ids[: i + 1], "length"
        return new_ids, None
