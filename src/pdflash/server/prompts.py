"""A request's prompt as token ids within the context, and the request defaults.

Owns the step every surface shares between a validated request and `engine.generate()`:
text is tokenized here (on a worker thread when long, so no request stalls the event
loop), the prompt is checked against `--max-prompt-tokens` and the context
(`--max-model-len`), and `prompt + max_tokens` beyond the context is a 400 naming
max_tokens (vLLM's behaviour) instead of a silent cut. A request that gives no max_tokens
gets the server default cut to the room left. Must not run the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pdflash.sampling import SamplingParams
from pdflash.server.errors import APIError, invalid
from pdflash.server.limits import off_loop
from pdflash.server.state import ServerState


def request_defaults(state: ServerState) -> dict[str, Any]:
    """SamplingParams fields a request omits: generation_config.json's, then max_tokens."""
    return {**state.settings.sampling_defaults, "max_tokens": state.settings.default_max_tokens}


async def encode(state: ServerState, prompt: str | list[int], *, param: str = "prompt") -> list[int]:
    """Token ids of a text or token-id prompt, checked against the vocabulary and the prompt limits."""
    if isinstance(prompt, str):
        tokenizer = state.engine.tokenizer
        if tokenizer is None:
            raise invalid(
                "this model has no tokenizer.json, so a text prompt cannot be encoded; pass a list of token ids",
                param=param,
            )
        ids = await off_loop(len(prompt), lambda: tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        vocab = state.engine.speculator.target.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param=param)
    if not ids:
        raise invalid("the prompt must contain at least one token, got an empty prompt", param=param)
    limit = state.settings.limits.max_prompt_tokens
    if limit is not None and len(ids) > limit:
        raise invalid(
            f"the prompt has {len(ids)} tokens; this server accepts at most {limit} (--max-prompt-tokens)",
            param=param,
            code="prompt_too_long",
        )
    return ids


def fit_context(
    state: ServerState,
    prompt_tokens: int,
    params: SamplingParams,
    *,
    max_tokens_given: bool,
    names: Mapping[str, str] | None = None,
) -> SamplingParams:
    """`params` checked against the context: 400 when prompt + max_tokens does not fit it.

    `names` maps "prompt" and "max_tokens" to the fields the client sent them as.
    """
    names = names or {}
    context = state.max_model_len
    room = context - prompt_tokens
    if room < 1:
        raise invalid(
            f"the prompt has {prompt_tokens} tokens but the context is {context} (--max-model-len); "
            f"at most {context - 1} prompt tokens fit",
            param=names.get("prompt", "prompt"),
            code="context_length_exceeded",
        )
    if params.max_tokens <= room:
        return params
    if max_tokens_given:
        name = names.get("max_tokens", "max_tokens")
        raise invalid(
            f"{name}={params.max_tokens} with a prompt of {prompt_tokens} tokens needs "
            f"{prompt_tokens + params.max_tokens} positions but the context is {context}; "
            f"{name} must be at most {room}",
            param=name,
            code="context_length_exceeded",
        )
    try:
        return attrs.evolve(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    except ValueError as exc:
        raise invalid(str(exc)) from None


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
