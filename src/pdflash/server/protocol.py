"""The OpenAI wire format: request validation and response/chunk bodies.

Owns which JSON fields a completion or chat request may carry, their types, and the
shape of every body the OpenAI endpoints send. Must not touch the engine: a request
becomes a prompt (text, token ids or chat messages) plus a SamplingParams, and outputs
come back in as plain values.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from pdflash.sampling import MAX_TOP_LOGPROBS, SamplingParams
from pdflash.server import chat_request
from pdflash.server.errors import APIError, invalid

# SamplingParams field -> the JSON type it takes on the wire ("number" excludes booleans)
SAMPLING_TYPES = {
    "temperature": "number",
    "top_p": "number",
    "top_k": "integer",
    "max_tokens": "integer",
    "stop": "string or array of strings",
    "stop_token_ids": "array of integers",
    "seed": "integer",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "repetition_penalty": "number",
    "min_p": "number",
    "min_tokens": "integer",
    "ignore_eos": "boolean",
}
# Fields OpenAI defines that pdflash accepts only at their no-op value (field -> accepted values)
NO_OP_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "logit_bias": ({},),
    "suffix": ("",),
}
MAX_N = 16  # choices per request
INT64 = (-(2**63), 2**63 - 1)  # every integer field must fit (seed, stop_token_ids, ...)
COMMON_FIELDS = {"model", "stream", "stream_options", "user", "n", "logprobs", *SAMPLING_TYPES, *NO_OP_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | chat_request.CHAT_FIELDS | {"max_completion_tokens", "top_logprobs"}


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    model: str | None  # the name the client asked for (None: the served model)
    prompt: str | list[int] | None  # completions: text or token ids
    chat: chat_request.ChatRequest | None  # chat: messages, tools, tool_choice, chat_template_kwargs
    params: SamplingParams
    max_tokens_given: bool  # the client set max_tokens (else the default, cut to the room in the context)
    n: int  # choices
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value <= INT64[1]


_CHECKS = {
    "number": _is_number,
    "integer": _is_integer,
    "string or array of strings": lambda v: (
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    ),
    "array of integers": lambda v: isinstance(v, list) and all(_is_integer(t) for t in v),
    "boolean": lambda v: isinstance(v, bool),
}
KIND_NAMES = {"integer": "integer in [-2**63, 2**63 - 1]", "array of integers": "array of 64-bit integers"}


def sampling_params(
    fields: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any],
    wire_names: Mapping[str, str] | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams from JSON fields (null = absent); a wrong type or value is a 400 naming the field.

    `defaults` holds the SamplingParams fields a request omits (max_tokens included);
    `wire_names` maps a SamplingParams field to the request field the client sent it as.
    """
    wire_names = wire_names or {}
    kwargs: dict[str, Any] = dict(defaults)
    for name, kind in SAMPLING_TYPES.items():
        value = fields.get(wire_names.get(name, name))
        if value is None:
            continue
        if not _CHECKS[kind](value):
            raise invalid(
                f"{wire_names.get(name, name)} must be a JSON {KIND_NAMES.get(kind, kind)}, got {_short(value)}",
                param=wire_names.get(name, name),
            )
        kwargs[name] = value
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams messages start with the field name ("temperature=-1 is ...")
        field = str(exc).split(maxsplit=1)[0].split("=", 1)[0]
        raise invalid(str(exc), param=wire_names.get(field, field) if field in SAMPLING_TYPES else None) from None


def _short(value: Any) -> str:
    return json.dumps(value)[:200]


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """SamplingParams.logprobs from the wire: completions `logprobs: k`; chat `logprobs: true` + `top_logprobs: k`."""
    value, limit = body.get("logprobs"), MAX_TOP_LOGPROBS
    if not chat:
        if value is None:
            return None
        if not _is_integer(value) or not 0 <= value <= limit:
            raise invalid(f"logprobs must be an integer in [0, {limit}], got {_short(value)}", param="logprobs")
        return value
    top = body.get("top_logprobs")
    if value is not None and not isinstance(value, bool):
        raise invalid(f"logprobs must be a boolean, got {_short(value)}", param="logprobs")
    if top is not None and (not _is_integer(top) or not 0 <= top <= limit):
        raise invalid(f"top_logprobs must be an integer in [0, {limit}], got {_short(top)}", param="top_logprobs")
    if top and not value:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if value else None


def parse_completion_request(body: Any, *, chat: bool, defaults: Mapping[str, Any]) -> CompletionRequest:
    """Validate a decoded request body; raises APIError (400) naming the offending field."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(
            f"unrecognized request argument supplied: {unknown[0]} (accepted: {sorted(allowed)})", param=unknown[0]
        )
    for name, accepted in NO_OP_FIELDS.items():
        if body.get(name) is not None and body[name] not in accepted:
            raise invalid(
                f"{name}={json.dumps(body[name])} is not supported; pdflash accepts only "
                f"{' or '.join(json.dumps(a) for a in accepted)}",
                param=name,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"model must be a string, got {json.dumps(model)}", param="model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid(f"stream must be a boolean, got {json.dumps(stream)}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise invalid(
            f'stream_options must be an object like {{"include_usage": true}}, got {json.dumps(options)}',
            param="stream_options",
        )
    n = body.get("n")
    if n is not None and (not _is_integer(n) or not 1 <= n <= MAX_N):
        raise invalid(f"n must be an integer in [1, {MAX_N}], got {_short(n)}", param="n")
    wire = {"max_tokens": "max_completion_tokens"} if chat and body.get("max_completion_tokens") is not None else {}
    params = sampling_params(body, defaults=defaults, wire_names=wire, logprobs=_logprobs(body, chat=chat))
    return CompletionRequest(
        model=model,
        prompt=None if chat else parse_prompt(body.get("prompt")),
        chat=chat_request.parse_chat_request(body) if chat else None,
        params=params,
        max_tokens_given=body.get(wire.get("max_tokens", "max_tokens")) is not None,
        n=n or 1,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def parse_prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_integer(t) for t in value):
        return value
    raise invalid(
        "prompt must be a non-empty string or a non-empty array of token ids (one prompt per request), "
        f"got {json.dumps(value)[:200]}",
        param="prompt",
    )


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


# -- response bodies ------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request_id: str,
    model: str,
    created: int,
    *,
    chat: bool,
    choices: list[dict[str, Any]],
    usage_: dict[str, int],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """The whole (non-streamed) response; `choices` from `whole_choice`."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "metrics": metrics,
    }


def whole_choice(
    index: int,
    *,
    chat: bool,
    text: str,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One whole choice; chat's parsed `message` (server.chat.message_body) replaces plain text."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
    if chat:
        choice["message"] = message or {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    *,
    chat: bool,
    text: str | None,
    reason: str | None,
    first: bool = False,
    metrics: dict[str, Any] | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; `first` (chat) carries the assistant role; `metrics` only on the last.

    Chat's parsed `delta` (server.chat.delta_body) replaces plain `text`.
    """
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
    if chat:
        fields: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            fields |= delta
        elif text is not None:
            fields["content"] = text
        choice["delta"] = fields
    else:
        choice["text"] = text or ""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if metrics is not None:
        body["metrics"] = metrics
    return body


def usage_chunk_body(request_id: str, model: str, created: int, *, chat: bool, usage_: dict[str, int]) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdflash", "max_model_len": max_model_len}


def now() -> int:
    return int(time.time())
