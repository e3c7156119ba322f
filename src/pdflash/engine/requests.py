"""What a request brings, checked at the engine's edge before anything is queued.

Owns turning a prompt (text or token ids) and sampling parameters (an object, a mapping of
its fields, or nothing) into validated values, with errors that name what was wrong and
what would be valid. Knows nothing of scheduling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pdflash.sampling import SamplingParams
from pdflash.target.tokenizer import TextTokenizer


def prompt_token_ids(prompt: str | list[int], tokenizer: TextTokenizer | None, vocab_size: int) -> list[int]:
    """The prompt as token ids in 0..vocab_size-1 (a text prompt needs the tokenizer)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "this model has no tokenizer.json, so a text prompt cannot be encoded; pass a list of token ids"
            )
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]!r} are not ints in the vocabulary 0..{vocab_size - 1}")
    if not ids:
        raise ValueError("the prompt must contain at least one token, got an empty prompt")
    return ids


def sampling_params(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """A SamplingParams from itself, a mapping of its fields (unknown fields refused) or None (defaults)."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(attrs.fields_dict(SamplingParams)))
        if unknown:
            raise ValueError(
                f"sampling_params has unknown fields {unknown}; valid: {sorted(attrs.fields_dict(SamplingParams))}"
            )
        return SamplingParams(**value)
    raise TypeError(
        f"sampling_params must be a SamplingParams, a mapping of its fields or None, got {type(value).__name__}"
    )
