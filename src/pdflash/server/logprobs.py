"""Logprobs on the wire: the OpenAI completions and chat shapes of the target's token logprobs.

Owns turning `TokenLogprob`s (token id, the target's log-softmax at it, the top-k
alternatives) into `choices[i].logprobs`. Must not compute them: the speculator does, from
the verify forward's logits, so speculative and plain decoding report the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdflash.sampling import TokenLogprob


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(items: Sequence[TokenLogprob], tokenizer: Any, offset: int = 0) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (legacy completions); `offset`: text before."""
    tokens = [token_text(tokenizer, lp.token_id) for lp in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def chat_logprobs(items: Sequence[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` (chat completions)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items]
    }
