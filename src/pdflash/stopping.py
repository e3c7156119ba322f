"""When a sequence stops: stop tokens, the new-token limit and the context limit."""

from __future__ import annotations

import attrs

from pdflash.errors import ContextLimitError
from pdflash.sampling import SamplingParams


@attrs.frozen(kw_only=True)
class StopRule:
    stop_ids: frozenset[int]  # finish right after emitting any of these
    max_new_tokens: int  # min(request's max_tokens, room left in the context)
    limited_by_context: bool  # the context, not max_tokens, sets max_new_tokens

    @classmethod
    def for_request(cls, prompt_len: int, params: SamplingParams, max_positions: int, eos_ids=()) -> StopRule:
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        room = max_positions - prompt_len
        if room < 1:
            raise ContextLimitError(
                f"prompt has {prompt_len} tokens but the model's context limit is {max_positions}; "
                f"at most {max_positions - 1} prompt tokens fit"
            )
        return cls(
            stop_ids=frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_ids),
            max_new_tokens=min(params.max_tokens, room),
            limited_by_context=room < params.max_tokens,
        )

    def clip(self, emitted: int, new_ids: list[int]) -> tuple[list[int], str | None]:
        """Cut `new_ids` (after `emitted` earlier tokens) at a stop token or the limit; say why it finished."""
        for i, token in enumerate(new_ids):
            if token in self.stop_ids:
                return new_ids[: i + 1], "stop"
            if emitted + i + 1 >= self.max_new_tokens:
                return new_ids[: i + 1], "length"
        return new_ids, None
