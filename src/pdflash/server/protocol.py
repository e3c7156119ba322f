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

from pdflash.sampling import SamplingParams
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
}
# Fields OpenAI defines that pdflash accepts only at their no-op value (field -> accepted values)
NO_OP_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "suffix": ("",),
}
COMMON_FIELDS = {"model", "stream", "stream_options", "user", *SAMPLING_TYPES, *NO_OP_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    model: str | None  # the name the client asked for (None: the served model)
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict[str, str]] | None  # chat: role/content pairs, content flattened to text
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc})", code="invalid_json") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS = {
    "number": _is_number,
    "integer": _is_integer,
    "string or array of strings": lambda v: (
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    ),
    "array of integers": lambda v: isinstance(v, list) and all(_is_integer(t) for t in v),
}


def sampling_params(
    fields: Mapping[str, Any], *, default_max_tokens: int, wire_names: Mapping[str, str] | None = None
) -> SamplingParams:
    """SamplingParams from JSON fields (null = absent); a wrong type or value is a 400 naming the field.

    `wire_names` maps a SamplingParams field to the request field the client sent it as.
    """
    wire_names = wire_names or {}
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens}
    for name, kind in SAMPLING_TYPES.items():
        value = fields.get(wire_names.get(name, name))
        if value is None:
            continue
        if not _CHECKS[kind](value):
            raise invalid(
                f"{wire_names.get(name, name)} must be a JSON {kind}, got {json.dumps(value)}",
                param=wire_names.get(name, name),
            )
        kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams messages start with the field name
        field = str(exc).split(maxsplit=1)[0]
        raise invalid(str(exc), param=wire_names.get(field, field) if field in SAMPLING_TYPES else None) from None


def parse_completion_request(body: Any, *, chat: bool, default_max_tokens: int) -> CompletionRequest:
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
    wire = {"max_tokens": "max_completion_tokens"} if chat and body.get("max_completion_tokens") is not None else {}
    params = sampling_params(body, default_max_tokens=default_max_tokens, wire_names=wire)
    return CompletionRequest(
        model=model,
        prompt=None if chat else parse_prompt(body.get("prompt")),
        messages=parse_messages(body.get("messages")) if chat else None,
        params=params,
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


def parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise invalid(
            f"messages must be a non-empty array of {{role, content}} objects, got {json.dumps(value)[:200]}",
            param="messages",
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}] must be an object with a role in {list(CHAT_ROLES)}, got {json.dumps(message)[:200]}",
                param=f"messages[{i}].role",
            )
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or an array of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(
        f"messages[{i}].content must be a string or an array of text parts, got {json.dumps(content)[:200]}",
        param=f"messages[{i}].content",
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
    text: str,
    reason: str | None,
    usage_: dict[str, int],
    metrics: dict[str, Any],
    reasoning: str | None = None,
) -> dict[str, Any]:
    """The whole (non-streamed) response; `reasoning` (chat) is the message's `reasoning_content`."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if reasoning is not None:
            choice["message"]["reasoning_content"] = reasoning
    else:
        choice["text"] = text
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
        "metrics": metrics,
    }


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
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk; `first` (chat) carries the assistant role; `metrics` only on the last."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {
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


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdflash"}


def now() -> int:
    return int(time.time())
