"""Input limits at the API edge: body size, JSON nesting, content type, and work kept off the event loop.

Owns how a request body becomes a JSON value without letting one request stall or exhaust
the server: the body is read in chunks and refused (413) once it passes the limit (before
reading anything when Content-Length already says so), only `application/json` is parsed
(415 otherwise: a cross-site "simple request" is `text/plain`), parsing a large body and
tokenizing a long prompt run on a worker thread, and nesting deeper than the limit is a 400
`invalid_json`. Must not know request fields: protocol.py validates the decoded value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import attrs
from starlette.requests import Request

from pdflash.server.errors import APIError, invalid

T = TypeVar("T")
OFF_LOOP_BYTES = 32 * 1024  # bodies / prompts at least this long are parsed / tokenized on a worker thread


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name}={value!r} is invalid: it must be an integer >= 1")


@attrs.frozen(kw_only=True)
class Limits:
    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive_int)  # HTTP request body
    max_ws_message_bytes: int = attrs.field(default=1024 * 1024, validator=_positive_int)  # one websocket message
    max_json_depth: int = attrs.field(default=32, validator=_positive_int)  # nested arrays / objects
    max_prompt_tokens: int | None = attrs.field(default=None)  # None: the context (max_model_len) decides

    def __attrs_post_init__(self) -> None:
        if self.max_prompt_tokens is not None:
            _positive_int(self, attrs.fields(Limits).max_prompt_tokens, self.max_prompt_tokens)


def too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is {size} bytes; this server accepts at most {limit} (--max-body-bytes)",
        code="request_too_large",
    )


def check_content_type(request: Request) -> None:
    """JSON endpoints take `application/json` only (415 otherwise)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            f"content-type must be application/json, got {media or 'none'!r}",
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it passes `limit` bytes (nothing more is read or kept)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def loads(raw: bytes | str, max_depth: int) -> Any:
    """Decode JSON; any failure (syntax, NaN/Infinity, too deep, a huge integer) is a 400 invalid_json."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise invalid(f"the JSON is nested deeper than {max_depth} levels", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integer digit limit, NaN
        raise invalid(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    depth = nesting_depth(value)
    if depth > max_depth:
        raise invalid(f"the JSON is nested {depth} levels deep; at most {max_depth} are accepted", code="invalid_json")
    return value


def nesting_depth(value: Any) -> int:
    """Levels of arrays / objects in a decoded JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


async def off_loop(size: int, fn: Callable[[], T]) -> T:
    """Run `fn` inline when its input is small, on a worker thread when it is `OFF_LOOP_BYTES` or more."""
    if size < OFF_LOOP_BYTES:
        return fn()
    return await anyio.to_thread.run_sync(fn)


async def read_json(request: Request, limits: Limits) -> Any:
    """A JSON request body within the limits (415, 413, 400 invalid_json otherwise)."""
    check_content_type(request)
    raw = await read_body(request, limits.max_body_bytes)
    return await off_loop(len(raw), lambda: loads(raw, limits.max_json_depth))
