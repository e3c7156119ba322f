"""POST /tokenize, POST /detokenize and GET /version (vLLM's shapes).

Owns turning text or chat messages into the model's token ids and back, exactly as the
completion endpoints would encode them (same tokenizer, same chat template, same limits).
Must not run the engine.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import pdflash
from pdflash.server import protocol
from pdflash.server.chat import prepare_turn
from pdflash.server.chat_request import parse_chat_request
from pdflash.server.errors import invalid
from pdflash.server.limits import off_loop, read_json
from pdflash.server.prompts import encode
from pdflash.server.state import ServerState

TOKENIZE_FIELDS = {"model", "prompt", "messages"}


class TokenizeRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def tokenize(self, request: Request) -> Response:
        """`{"prompt": str}` or `{"messages": [...]}` → `{"tokens", "count", "max_model_len"}`."""
        body = await self._body(request, TOKENIZE_FIELDS)
        if ("prompt" in body) == ("messages" in body):
            raise invalid('give exactly one of "prompt" (text) or "messages" (chat)', param="prompt")
        if "messages" in body:
            chat = parse_chat_request({"messages": body["messages"]})
            size = sum(len(str(m.get("content") or "")) for m in chat.messages)
            text = await off_loop(size, lambda: prepare_turn(self.state.chat, chat, streaming=False).prompt)
            ids = await encode(self.state, text, param="messages")
        else:
            if not isinstance(body["prompt"], str):
                raise invalid(f"prompt must be a string, got {json.dumps(body['prompt'])[:200]}", param="prompt")
            ids = await encode(self.state, body["prompt"])
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.state.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        """`{"tokens": [ids]}` → `{"prompt": text}`."""
        body = await self._body(request, {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = self.state.engine.speculator.target.config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise invalid(
                f"tokens must be an array of token ids in 0..{vocab - 1}, got {json.dumps(tokens)[:200]}",
                param="tokens",
            )
        tokenizer = self.state.engine.tokenizer
        if tokenizer is None:
            raise invalid("this model has no tokenizer.json, so token ids cannot be decoded", param="tokens")
        text = await off_loop(len(tokens), lambda: tokenizer.decode(tokens))
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pdflash.__version__})

    async def _body(self, request: Request, fields: set[str]) -> dict[str, Any]:
        body = await read_json(request, self.state.settings.limits)
        if not isinstance(body, dict):
            raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise invalid(f"unrecognized field {unknown[0]!r} (accepted: {sorted(fields)})", param=unknown[0])
        protocol.check_model(body.get("model"), self.state.settings.model_name)
        return body
