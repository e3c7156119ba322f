"""The OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions.

Owns the request path from HTTP body to engine stream and back: validation, the chat
template, streamed (SSE) and whole responses, `n` choices (one engine request each),
logprobs, and aborting the engine requests when the client leaves. Must not touch engine
internals: it calls `engine.generate()` and reads the deltas it yields.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdflash.chat.deltas import EMPTY, ChatMessage
from pdflash.engine.outputs import RequestOutput
from pdflash.sampling import SEED_RANGE, SamplingParams, TokenLogprob
from pdflash.server import protocol
from pdflash.server.chat import ChatTurn, delta_body, message_body, prepare_turn
from pdflash.server.errors import SERVER_ERROR, APIError, from_engine_error
from pdflash.server.limits import off_loop, read_json
from pdflash.server.logprobs import chat_logprobs, completion_logprobs
from pdflash.server.metrics import RequestTracker
from pdflash.server.prompts import encode, fit_context, request_defaults, shutting_down
from pdflash.server.sse import DONE, EventStreamResponse, event, unless_disconnected
from pdflash.server.state import ServerState

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never seen by the client


class CompletionRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def completions(self, request: Request) -> Response | EventStreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | EventStreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, *, chat: bool) -> Response | EventStreamResponse:
        state = self.state
        if state.streams.draining:
            raise shutting_down()
        body = await read_json(request, state.settings.limits)
        req = protocol.parse_completion_request(body, chat=chat, defaults=request_defaults(state))
        protocol.check_model(req.model, state.settings.model_name)
        names = {"prompt": "messages" if chat else "prompt"}
        if chat and body.get("max_completion_tokens") is not None:
            names["max_tokens"] = "max_completion_tokens"
        prompt: str | list[int]
        turns: list[ChatTurn] | None = None  # one per choice: each parses its own output
        if req.chat is not None:
            chat_req = req.chat
            size = sum(len(str(m.get("content") or "")) for m in chat_req.messages)
            turns = await off_loop(
                size, lambda: [prepare_turn(state.chat, chat_req, streaming=req.stream) for _ in range(req.n)]
            )
            prompt = turns[0].prompt
        else:
            assert req.prompt is not None  # parse_completion_request gives completions a prompt
            prompt = req.prompt
        prompt_ids = await encode(state, prompt, param=names["prompt"])
        params = fit_context(state, len(prompt_ids), req.params, max_tokens_given=req.max_tokens_given, names=names)
        if turns is not None:
            params = turns[0].sampling(params)  # the chat family's turn-ending tokens stop it too
        request_id = protocol.new_id(chat)
        ids = [request_id] if req.n == 1 else [f"{request_id}-{i}" for i in range(req.n)]
        streams: list[AsyncGenerator[RequestOutput, None]] = []  # engine.generate's async generators
        try:
            for i, rid in enumerate(ids):
                streams.append(state.engine.generate(prompt_ids, _choice_params(params, i), request_id=rid))
                state.streams.open(rid)
        except Exception as error:
            for rid in ids:
                await state.release(rid)
                state.streams.close(rid)
            param_of = {**{f: f for f in protocol.SAMPLING_TYPES}, **names}
            raise from_engine_error(error, param_of=param_of) from None
        if state.streams.draining:  # shutdown began while this request was parsed: it ends at once ("abort")
            for rid in ids:
                await state.engine.abort(rid)
        reply = _Reply(
            state, request_id, protocol.now(), chat=chat, ids=ids, logprobs=params.logprobs is not None, turns=turns
        )
        if req.stream:
            return EventStreamResponse(reply.events(streams, include_usage=req.include_usage), on_close=reply.release)
        try:
            whole = await unless_disconnected(request.receive, lambda: reply.whole(streams))
        finally:
            await reply.release()
        if whole is None:
            return Response(status_code=CLIENT_CLOSED)  # the engine requests were aborted when `whole` was cancelled
        return JSONResponse(whole)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a seeded request samples with seed + index (so n choices differ, reproducibly)."""
    if index == 0 or params.seed is None:
        return params
    low, high = SEED_RANGE
    return attrs.evolve(params, seed=(params.seed + index - low) % (high - low + 1) + low)


class _Reply:
    """Turns one request's engine streams (one per choice) into an OpenAI response, whole or streamed."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        created: int,
        *,
        chat: bool,
        ids: list[str],
        logprobs: bool,
        turns: list[ChatTurn] | None = None,
    ) -> None:
        self.state, self.request_id, self.created, self.chat, self.ids = state, request_id, created, chat, ids
        self.turns = turns  # chat: each choice's parser (reasoning, tool calls); None: plain text
        self.logprobs = logprobs  # the client asked for logprobs
        self.model = state.settings.model_name
        self.trackers = [RequestTracker(state.metrics) for _ in ids]  # one per choice
        self.offsets = [0] * len(ids)  # completions logprobs: text already sent per choice

    async def release(self) -> None:
        """Abort whatever is still live and stop counting these streams for shutdown."""
        for rid in self.ids:
            await self.state.release(rid)
            self.state.streams.close(rid)

    def _logprobs(self, index: int, items: tuple[TokenLogprob, ...], text: str) -> dict | None:
        if not self.logprobs:
            return None
        tokenizer = self.state.engine.tokenizer
        if self.chat:
            return chat_logprobs(items, tokenizer)
        wire = completion_logprobs(items, tokenizer, self.offsets[index])
        self.offsets[index] += len(text)
        return wire

    async def whole(self, streams: list[AsyncGenerator[RequestOutput, None]]) -> dict[str, Any]:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        summary: dict[str, Any] = {}
        for index, stream in enumerate(streams):
            text, out, tracker = [], None, self.trackers[index]
            turn = self.turns[index] if self.turns is not None else None
            parsed = [turn.start()] if turn is not None else []
            logprobs: list[TokenLogprob] = []
            try:
                async with aclosing(stream):
                    async for out in stream:
                        tracker.update(out)
                        text.append(out.text)
                        logprobs += out.logprobs
                        if turn is not None:
                            parsed.append(turn.feed(out))
            except Exception as error:
                log.error("request %s failed: %r", self.ids[index], error)
                raise APIError(500, f"generation failed: {error}", type=SERVER_ERROR) from None
            assert out is not None  # a stream ends with its final delta
            wire = self._logprobs(index, tuple(logprobs), "".join(text))
            message = message_body(ChatMessage.assemble([*parsed, turn.finish()])) if turn is not None else None
            reason = turn.finish_reason(out.finish_reason) if turn is not None else out.finish_reason
            choices.append(
                protocol.whole_choice(
                    index, chat=self.chat, text="".join(text), reason=reason, logprobs=wire, message=message
                )
            )
            prompt_tokens = out.metrics.prompt_tokens
            completion_tokens += out.metrics.generated_tokens
            summary = summary or tracker.summary(out)
        return protocol.completion_body(
            self.request_id,
            self.model,
            self.created,
            chat=self.chat,
            choices=choices,
            usage_=protocol.usage(prompt_tokens, completion_tokens),
            metrics=summary,  # choice 0's
        )

    async def events(
        self, streams: list[AsyncGenerator[RequestOutput, None]], *, include_usage: bool
    ) -> AsyncGenerator[str, None]:
        """Chunks of every choice (choice i after choice i-1: all of them generate concurrently), then [DONE]."""
        out = None
        for index, stream in enumerate(streams):
            chunk = functools.partial(self._chunk, index=index)
            tracker = self.trackers[index]
            turn = self.turns[index] if self.turns is not None else None
            async with aclosing(stream):
                if self.chat:
                    yield event(chunk(text="", reason=None, first=True))
                if turn is not None and not (forced := turn.start()).empty:
                    yield event(chunk(text=None, reason=None, delta=delta_body(forced)))
                try:
                    async for out in stream:
                        tracker.update(out)
                        wire = self._logprobs(index, out.logprobs, out.text) if out.text or out.logprobs else None
                        if turn is None:
                            if out.text or out.logprobs:
                                yield event(chunk(text=out.text, reason=None, logprobs=wire))
                        else:
                            parsed = turn.feed(out) + (turn.finish() if out.finished else EMPTY)
                            if not parsed.empty or wire is not None:
                                yield event(chunk(text=None, reason=None, delta=delta_body(parsed), logprobs=wire))
                        if out.finished:
                            reason = turn.finish_reason(out.finish_reason) if turn is not None else out.finish_reason
                            yield event(chunk(text=None, reason=reason, metrics=tracker.summary(out)))
                except Exception as error:  # this request failed in the engine: tell the client, end the stream
                    log.error("request %s failed: %r", self.ids[index], error)
                    yield event(APIError(500, f"generation failed: {error}", type=SERVER_ERROR).body())
                    yield DONE
                    return
        if include_usage and out is not None:
            usage = protocol.usage(out.metrics.prompt_tokens, sum(t.tokens for t in self.trackers))
            yield event(
                protocol.usage_chunk_body(self.request_id, self.model, self.created, chat=self.chat, usage_=usage)
            )
        yield DONE

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        return protocol.chunk_body(self.request_id, self.model, self.created, chat=self.chat, **fields)
