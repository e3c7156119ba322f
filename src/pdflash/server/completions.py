"""The OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions.

Owns the request path from HTTP body to engine stream and back: validation, the chat
template, streamed (SSE) and whole responses, and aborting the engine request when the
client leaves. Must not touch engine internals: it calls `engine.generate()` and reads the
deltas it yields.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdflash.engine.outputs import RequestOutput
from pdflash.server import harmony, protocol
from pdflash.server.errors import SERVER_ERROR, APIError, from_engine_error, invalid
from pdflash.server.metrics import RequestTracker
from pdflash.server.sse import DONE, EventStreamResponse, event, unless_disconnected
from pdflash.server.state import ServerState

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never seen by the client


class CompletionRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        state = self.state
        body = protocol.parse_json(await request.body())
        req = protocol.parse_completion_request(body, chat=chat, default_max_tokens=state.settings.default_max_tokens)
        protocol.check_model(req.model, state.settings.model_name)
        prompt = chat_prompt(state, req.messages) if chat else req.prompt
        request_id = protocol.new_id(chat)
        try:
            stream = state.engine.generate(prompt, req.params, request_id=request_id)
        except Exception as error:
            wire = {"max_tokens": "max_completion_tokens"} if chat and body.get("max_completion_tokens") else {}
            raise from_engine_error(
                error,
                param_of={
                    **{f: f for f in protocol.SAMPLING_TYPES},
                    **wire,
                    "prompt": "messages" if chat else "prompt",
                },
            ) from None
        reply = _Reply(state, request_id, protocol.now(), chat=chat)
        if req.stream:
            return EventStreamResponse(
                reply.events(stream, include_usage=req.include_usage), on_close=lambda: state.release(request_id)
            )
        body = await unless_disconnected(request.receive, lambda: reply.whole(stream))
        if body is None:
            return Response(status_code=CLIENT_CLOSED)  # the engine request was aborted when `whole` was cancelled
        return JSONResponse(body)


def chat_prompt(state: ServerState, messages: list[dict[str, str]]) -> str:
    """The model's chat template applied to `messages`, ending with the assistant's turn."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise invalid(
            "this model has no tokenizer.json, so chat messages cannot be encoded; use /v1/completions with token ids",
            param="messages",
        )
    try:
        return tokenizer.apply_chat_template(messages)
    except (ValueError, jinja2.TemplateError) as exc:
        raise invalid(f"the chat template rejected these messages: {exc}", param="messages") from None


class _Reply:
    """Turns one request's engine stream into an OpenAI response (whole or streamed chunks)."""

    def __init__(self, state: ServerState, request_id: str, created: int, *, chat: bool) -> None:
        self.state, self.request_id, self.created, self.chat = state, request_id, created, chat
        self.model = state.settings.model_name
        self.tracker = RequestTracker(state.metrics)
        self.harmony = chat and harmony.speaks_harmony(state.engine.tokenizer)  # split channels (gpt-oss)

    async def whole(self, stream: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        text, out = [], None
        try:
            async with aclosing(stream):
                async for out in stream:
                    self.tracker.update(out)
                    text.append(out.text)
        except Exception as error:
            log.error("request %s failed: %r", self.request_id, error)
            raise APIError(500, f"generation failed: {error}", type=SERVER_ERROR) from None
        finally:
            await self.state.release(self.request_id)
        m = out.metrics
        content, reasoning = harmony.split_channels("".join(text)) if self.harmony else ("".join(text), None)
        return protocol.completion_body(
            self.request_id,
            self.model,
            self.created,
            chat=self.chat,
            text=content,
            reason=out.finish_reason,
            usage_=protocol.usage(m.prompt_tokens, m.generated_tokens),
            metrics=self.tracker.summary(out),
            reasoning=reasoning,
        )

    async def events(self, stream: AsyncIterator[RequestOutput], *, include_usage: bool) -> AsyncGenerator[str, None]:
        chunk = self._chunk
        channels = harmony.ChannelSplitter() if self.harmony else None
        async with aclosing(stream):
            if self.chat:
                yield event(chunk(text="", reason=None, first=True))
            try:
                async for out in stream:
                    self.tracker.update(out)
                    if channels is not None:
                        pieces = channels.feed(out.text) + (channels.finish() if out.finished else [])
                        for piece in pieces:
                            yield event(chunk(**_channel_fields(piece), reason=None))
                    elif out.text:
                        yield event(chunk(text=out.text, reason=None))
                    if out.finished:
                        yield event(chunk(text=None, reason=out.finish_reason, metrics=self.tracker.summary(out)))
            except Exception as error:  # this request failed in the engine: tell the client, end the stream
                log.error("request %s failed: %r", self.request_id, error)
                yield event(APIError(500, f"generation failed: {error}", type=SERVER_ERROR).body())
                yield DONE
                return
        if include_usage:
            usage = protocol.usage(out.metrics.prompt_tokens, self.tracker.tokens)
            yield event(
                protocol.usage_chunk_body(self.request_id, self.model, self.created, chat=self.chat, usage_=usage)
            )
        yield DONE

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        return protocol.chunk_body(self.request_id, self.model, self.created, chat=self.chat, **fields)


def _channel_fields(piece: harmony.ChannelDelta) -> dict[str, str | None]:
    return {"text": None, "reasoning": piece.text} if piece.reasoning else {"text": piece.text}
