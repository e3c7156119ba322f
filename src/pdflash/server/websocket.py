"""The websocket endpoint `/ws`: many concurrent generations per socket, live deltas and stats.

Owns one connection's life: reading and validating client messages (start, cancel), one
task per running generation, a single writer (so messages never interleave), and the
periodic engine-wide `stats` message. Protocol: docs/websocket.md. A malformed message
gets an `error` message and the socket stays open; a generation ends with exactly one
`done` or one `error` carrying its id. With an API key, the socket is authenticated by
its query string (`?api_key=KEY`), an `Authorization: Bearer` header, or a first message
`{"type": "auth", "api_key": KEY}` (server/auth.py). Must not touch engine internals: it
calls `engine.generate()` and closes the stream to abort.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any

import anyio
import anyio.abc
from starlette.websockets import WebSocket

from pdflash.chat.deltas import EMPTY
from pdflash.sampling import SamplingParams
from pdflash.server import protocol
from pdflash.server.auth import websocket_authenticated
from pdflash.server.chat import ChatTurn, delta_body, prepare_turn
from pdflash.server.chat_request import CHAT_FIELDS, parse_chat_request
from pdflash.server.errors import APIError, from_engine_error, invalid
from pdflash.server.limits import loads, off_loop
from pdflash.server.metrics import RequestTracker
from pdflash.server.prompts import encode, fit_context, request_defaults
from pdflash.server.state import ServerState

log = logging.getLogger(__name__)
OUTBOX = 256  # messages queued for the writer; generations wait (their engine mailbox merges) when full
START_FIELDS = {"type", "id", "prompt", "params"} | CHAT_FIELDS
WS_PARAMS = {*protocol.SAMPLING_TYPES, "logprobs"}
POLICY_VIOLATION = 1008  # websocket close code: not authenticated
_connections = itertools.count()


async def websocket_endpoint(state: ServerState, websocket: WebSocket) -> None:
    await WebSocketSession(state, websocket).run()


class WebSocketSession:
    def __init__(self, state: ServerState, websocket: WebSocket) -> None:
        self.state = state
        self.websocket = websocket
        self.name = f"ws{next(_connections)}"
        self.requests = itertools.count()
        self.running: dict[str, anyio.CancelScope] = {}  # json.dumps(client id) -> the generation's scope
        # (message, request id whose final message it is, or None)
        self.outbox, self._outbox_reader = anyio.create_memory_object_stream[tuple[dict, str | None]](OUTBOX)
        self.tasks: anyio.abc.TaskGroup | None = None
        self.opened: set[str] = set()  # engine requests started here (state.streams counts them until final)

    async def run(self) -> None:
        await self.websocket.accept()
        if not await websocket_authenticated(self.state.settings.api_key, self.websocket):
            return
        self.state.metrics.ws_connections.inc()
        try:
            async with anyio.create_task_group() as tasks:
                self.tasks = tasks
                tasks.start_soon(self._write)
                tasks.start_soon(self._send_stats)
                await self._read()  # returns when the client disconnects
                tasks.cancel_scope.cancel()  # running generations close their streams: the engine aborts them
        finally:
            self.state.metrics.ws_connections.dec()
            for request_id in self.opened:  # a final message that could not go out: the client is gone
                self.state.streams.close(request_id)

    # -- reading --------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            msg_id = None
            try:
                msg = await _decode(message, self.state.settings.limits.max_json_depth)
                msg_id = msg.get("id")
                kind = msg.get("type")
                if kind == "start":
                    await self._start(msg)
                elif kind == "cancel":
                    self._cancel(msg)
                else:
                    raise invalid(
                        f'unknown message type {json.dumps(kind)}; the client sends "start" or "cancel"',
                        param="type",
                        code="unknown_type",
                    )
                self.state.metrics.ws_messages.labels(type=kind).inc()
            except APIError as error:
                self.state.metrics.ws_messages.labels(type="invalid").inc()
                # a duplicate_id error carries no id: that id's running generation still ends with its own done
                await self._post(_error(error, None if error.code == "duplicate_id" else msg_id))
            except Exception as error:  # a bug: report it, keep the socket and the server
                log.exception("websocket message handling failed")
                await self._post(
                    {
                        "type": "error",
                        "id": msg_id,
                        "code": "internal_error",
                        "param": None,
                        "message": f"internal error: {error!r}",
                    }
                )

    async def _start(self, msg: dict[str, Any]) -> None:
        if self.state.streams.draining:
            raise invalid("the server is shutting down", code="shutting_down")
        unknown = sorted(set(msg) - START_FIELDS)
        if unknown:
            raise invalid(
                f"unknown field {unknown[0]!r} in a start message (fields: {sorted(START_FIELDS)})",
                param=unknown[0],
                code="invalid_message",
            )
        gen_id, key = _client_id(msg)
        if key in self.running:
            raise invalid(
                f"a generation with id {json.dumps(gen_id)} is already running on this socket; "
                "ids must be unique among running generations",
                param="id",
                code="duplicate_id",
            )
        if len(self.running) >= self.state.settings.max_ws_generations:
            raise invalid(
                f"{len(self.running)} generations are already running on this socket "
                f"(max {self.state.settings.max_ws_generations}); wait for one to finish",
                code="too_many_generations",
            )
        params = msg.get("params") or {}
        if not isinstance(params, dict):
            raise invalid(
                f"params must be an object, got {json.dumps(params)[:200]}", param="params", code="invalid_params"
            )
        unknown = sorted(set(params) - WS_PARAMS)
        if unknown:
            raise invalid(
                f"unknown sampling parameter {unknown[0]!r}; valid: {sorted(WS_PARAMS)}",
                param=f"params.{unknown[0]}",
                code="invalid_params",
            )
        sampling = _sampling(params, request_defaults(self.state))
        # this socket's next message waits while a long prompt is encoded (on a worker thread)
        prompt, turn = await self._prompt(msg)
        prompt_ids = await encode(self.state, prompt)
        sampling = fit_context(
            self.state,
            len(prompt_ids),
            sampling,
            max_tokens_given=params.get("max_tokens") is not None,
            names={"max_tokens": "params.max_tokens"},
        )
        if turn is not None:
            sampling = turn.sampling(sampling)  # the chat family's turn-ending tokens stop it too
        request_id = f"{self.name}-{next(self.requests)}"
        try:
            stream = self.state.engine.generate(prompt_ids, sampling, request_id=request_id)
        except Exception as error:
            param_of = {f: f"params.{f}" for f in protocol.SAMPLING_TYPES} | {"prompt": "prompt"}
            raise from_engine_error(error, param_of=param_of) from None
        scope = anyio.CancelScope()
        self.running[key] = scope
        self.state.streams.open(request_id)  # until its done / error has been sent
        self.opened.add(request_id)
        if self.state.streams.draining:  # shutdown began while the prompt was encoded: it ends at once ("abort")
            await self.state.engine.abort(request_id)
        assert self.tasks is not None  # set by run() before it reads messages
        self.tasks.start_soon(self._generate, gen_id, key, request_id, stream, scope, turn)

    async def _prompt(self, msg: dict[str, Any]) -> tuple[str | list[int], ChatTurn | None]:
        if ("prompt" in msg) == ("messages" in msg):
            raise invalid(
                'a start message needs exactly one of "prompt" (text or token ids) or "messages"',
                param="prompt",
                code="invalid_message",
            )
        if "messages" in msg:
            request = parse_chat_request(msg)
            size = sum(len(str(m.get("content") or "")) for m in request.messages)
            turn = await off_loop(size, lambda: prepare_turn(self.state.chat, request, streaming=True))
            return turn.prompt, turn
        chat_only = sorted(set(msg) & (CHAT_FIELDS - {"messages"}))
        if chat_only:
            raise invalid(
                f"{chat_only[0]!r} goes with chat messages; a start message with a plain prompt cannot have it",
                param=chat_only[0],
                code="invalid_message",
            )
        return protocol.parse_prompt(msg["prompt"]), None

    def _cancel(self, msg: dict[str, Any]) -> None:
        gen_id, key = _client_id(msg)
        scope = self.running.get(key)
        if scope is None:
            raise invalid(
                f"no generation with id {json.dumps(gen_id)} is running on this socket", param="id", code="unknown_id"
            )
        scope.cancel()  # the generation sends its `done` (finish_reason "abort")

    # -- generations ----------------------------------------------------------------------

    async def _generate(
        self, gen_id: Any, key: str, request_id: str, stream, scope: anyio.CancelScope, turn: ChatTurn | None
    ) -> None:
        tracker, out, failure = RequestTracker(self.state.metrics), None, None
        parsed = turn.start() if turn is not None else EMPTY  # a forced tool-call start goes out with the first
        try:
            with scope:
                async with aclosing(stream):
                    async for out in stream:
                        delta = tracker.update(out)
                        if turn is not None:
                            parsed += turn.feed(out) + (turn.finish() if out.finished else EMPTY)
                        if out.token_ids or out.text or not parsed.empty:
                            message = _delta(gen_id, out, delta, tracker.tokens)
                            if turn is not None:
                                message["delta"], parsed = delta_body(parsed), EMPTY
                            await self._post(message)
        except Exception as error:  # this request failed in the engine
            failure = error
        finally:
            self.running.pop(key, None)  # before `done` goes out, so the client may reuse the id at once
            await self.state.release(request_id)
            # counted here, so a generation ended by the socket closing (this task cancelled) counts too
            reason = (
                "error" if failure is not None else out.finish_reason if out is not None and out.finished else "abort"
            )
            reason = turn.finish_reason(reason) if turn is not None else reason
            self.state.metrics.ws_generations.labels(outcome=reason).inc()
        if failure is not None:
            body = {"code": "generation_failed", "param": None, "message": f"generation failed: {failure}"}
            await self._post({"type": "error", "id": gen_id, **body}, request_id)
            return
        metrics = tracker.summary(out) if out is not None else {"generated_tokens": 0}
        await self._post({"type": "done", "id": gen_id, "finish_reason": reason, "metrics": metrics}, request_id)

    # -- writing --------------------------------------------------------------------------

    async def _post(self, message: dict[str, Any], final_of: str | None = None) -> None:
        """Queue `message` for the writer; `final_of`: the request whose last message it is."""
        await self.outbox.send((message, final_of))

    async def _write(self) -> None:
        try:
            async for message, final_of in self._outbox_reader:
                await self.websocket.send_text(json.dumps(message, separators=(",", ":")))
                if final_of is not None:
                    self.state.streams.close(final_of)
                    self.opened.discard(final_of)
        except Exception:  # the client is gone (or the transport broke): end the session
            assert self.tasks is not None
            self.tasks.cancel_scope.cancel()

    async def _send_stats(self) -> None:
        while True:
            with contextlib.suppress(anyio.WouldBlock):  # the client is behind: the next one is newer anyway
                self.outbox.send_nowait((self.state.board.current(), None))
            await anyio.sleep(self.state.settings.stats_interval_s)


async def _decode(message: Mapping[str, Any], max_depth: int) -> dict[str, Any]:
    text = message.get("text")
    if text is None:
        raise invalid("binary frames are not part of the protocol; send JSON text", code="invalid_message")
    msg = await off_loop(len(text), lambda: loads(text, max_depth))
    if not isinstance(msg, dict):
        raise invalid(
            f'a message must be a JSON object with a "type", got {type(msg).__name__}', code="invalid_message"
        )
    return msg


def _delta(gen_id: Any, out: Any, delta: Any, generated_tokens: int) -> dict[str, Any]:
    message = {
        "type": "delta",
        "id": gen_id,
        "text": out.text,
        "token_ids": list(out.token_ids),
        "acceptance_length": delta.acceptance_lengths[-1] if delta.acceptance_lengths else None,
        "acceptance_lengths": list(delta.acceptance_lengths),
        "block_sizes": list(delta.block_sizes),
        "expert_bytes": delta.expert_bytes,
        "fetch_bytes": delta.fetch_bytes,
        "generated_tokens": generated_tokens,
    }
    if out.logprobs:  # the start asked for params.logprobs
        message["logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in out.logprobs
        ]
    return message


def _sampling(params: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a start message's `params` (`logprobs`: an integer, as in /v1/completions)."""
    try:
        logprobs = params.get("logprobs")
        if logprobs is not None and not (isinstance(logprobs, int) and not isinstance(logprobs, bool)):
            raise invalid(f"logprobs must be an integer, got {json.dumps(logprobs)[:200]}", param="logprobs")
        return protocol.sampling_params(params, defaults=defaults, logprobs=logprobs)
    except APIError as error:
        raise invalid(
            error.message, param=f"params.{error.param}" if error.param else "params", code="invalid_params"
        ) from None


def _client_id(msg: dict[str, Any]) -> tuple[Any, str]:
    gen_id = msg.get("id")
    valid = (isinstance(gen_id, str) and gen_id) or (isinstance(gen_id, int) and not isinstance(gen_id, bool))
    if not valid:
        raise invalid(
            f"id must be a non-empty string or an integer, got {json.dumps(gen_id)}", param="id", code="invalid_message"
        )
    return gen_id, json.dumps(gen_id)


def _error(error: APIError, msg_id: Any) -> dict[str, Any]:
    code = error.code or ("invalid_request" if error.status == 400 else error.type)
    return {"type": "error", "id": msg_id, "code": code, "param": error.param, "message": error.message}
