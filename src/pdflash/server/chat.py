"""Chat turns on the wire: a request rendered into a prompt, its output parsed, and the OpenAI shapes.

Owns the server's chat setup (template, family, the tokens that end a turn), rendering a
validated request (`chat_request`) through the served chat template, the per-turn output
parser (from the model's chat family), and the OpenAI shapes of what it yields: `message`
with `reasoning_content` and `tool_calls`, streamed `delta`s with incremental `arguments`,
`finish_reason: "tool_calls"`, and the family's turn-ending tokens added to a chat
request's stop ids. Shared by the HTTP endpoint and the websocket. Must not touch the
engine: a turn reads the deltas `engine.generate()` yields.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pdflash.chat.deltas import EMPTY, ChatDelta, ChatMessage, OutputParser
from pdflash.chat.families import ChatFamily, TurnSetup, family_for
from pdflash.chat.template import ChatTemplate, ChatTemplateError
from pdflash.engine.outputs import RequestOutput
from pdflash.sampling import SamplingParams
from pdflash.server.chat_request import ChatRequest
from pdflash.server.errors import invalid


@attrs.frozen(kw_only=True)
class ChatSetup:
    """The server's chat configuration: its template, its family and the tokens that end a turn."""

    template: ChatTemplate | None
    family: ChatFamily
    end_tokens: Mapping[int, str]  # special token id -> text; dropped from the end of a turn's content
    stop_token_ids: tuple[int, ...] = ()  # the family's stop markers in this tokenizer (harmony's <|call|>)

    @classmethod
    def create(cls, tokenizer: Any, *, template_file: Path | str | None = None, parser: str = "auto") -> ChatSetup:
        """From the engine's tokenizer (None: no chat), `--chat-template FILE` and `--chat-parser NAME`."""
        template = tokenizer.chat_template if tokenizer is not None else None
        if template_file is not None:
            path = Path(template_file)
            if not path.is_file():
                raise ValueError(f"--chat-template {str(path)!r} is not a file; give the path of a jinja template")
            special = template.special_tokens if template is not None else {}
            try:
                template = ChatTemplate.from_source(path.read_text(encoding="utf-8"), special)
            except ValueError as exc:
                raise ValueError(f"--chat-template {str(path)!r}: {exc}") from None
        family = family_for(parser, template.source if template is not None else None)
        stops = [tokenizer.token_id(m) for m in family.stop_markers] if tokenizer is not None else []
        return cls(
            template=template,
            family=family,
            end_tokens=tokenizer.special_tokens() if tokenizer is not None else {},
            stop_token_ids=tuple(i for i in stops if i is not None),
        )


# -- one turn -------------------------------------------------------------------------------------


class ChatTurn:
    """A request's prompt and the parser its output goes through."""

    def __init__(
        self,
        prompt: str,
        prefix: str,
        parser: OutputParser,
        end_tokens: Mapping[int, str],
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.prompt = prompt + prefix  # what the engine is asked to continue
        self.prefix = prefix  # forced start of the turn (tool_choice), parsed as if the model wrote it
        self.parser, self.end_tokens, self.stop_token_ids = parser, end_tokens, stop_token_ids
        self.tool_calls = 0

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with the family's turn-ending tokens among its stop ids (unless it ignores EOS)."""
        extra = tuple(t for t in self.stop_token_ids if t not in params.stop_token_ids)
        if not extra or params.ignore_eos:
            return params
        return attrs.evolve(params, stop_token_ids=params.stop_token_ids + extra)

    def start(self) -> ChatDelta:
        return self._count(self.parser.feed(self.prefix, ())) if self.prefix else EMPTY

    def feed(self, out: RequestOutput) -> ChatDelta:
        text = out.text
        if out.finished and out.finish_reason == "stop" and out.token_ids:
            end = self.end_tokens.get(out.token_ids[-1])
            if end and text.endswith(end):
                text = text[: -len(end)]  # the end-of-turn token is not part of the message
        return self._count(self.parser.feed(text, out.token_ids))

    def finish(self) -> ChatDelta:
        return self._count(self.parser.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def _count(self, delta: ChatDelta) -> ChatDelta:
        self.tool_calls += sum(1 for d in delta.tool_calls if d.id is not None)
        return delta


def prepare_turn(setup: ChatSetup, request: ChatRequest, *, streaming: bool, param: str = "messages") -> ChatTurn:
    """Render the request and set up its parser; a template or family refusal is a 400."""
    if setup.template is None:
        raise invalid(
            "this model has no chat template (tokenizer_config.json or chat_template.jinja); "
            "start the server with --chat-template FILE or use /v1/completions",
            param=param,
        )
    choice, family = request.tool_choice, setup.family
    parse_tools_out = request.tools is not None and choice.mode != "none"
    if parse_tools_out and not family.parses_tool_calls:
        raise invalid(
            f"this server's chat family {family.name!r} has no tool-call parser; "
            "start it with --chat-parser naming a family with one (qwen3, harmony), or send no tools",
            param="tools",
        )
    try:
        prompt = setup.template.render(
            request.messages,
            tools=request.tools if choice.mode != "none" else None,  # "none": the model is not told of tools
            documents=request.documents,
            **request.template_kwargs,
        )
    except ChatTemplateError as exc:
        raise invalid(f"the chat template rejected this request: {exc}", param=param) from None
    turn = TurnSetup(
        prompt=prompt,
        tool_names=frozenset(t["function"]["name"] for t in request.tools or []) if parse_tools_out else None,
        max_calls=None if request.parallel_tool_calls else 1,
        streaming=streaming,
    )
    prefix = family.forcing_prefix(prompt, choice) if choice.forced and family.forcing_prefix is not None else ""
    return ChatTurn(prompt, prefix, family.new_parser(turn), setup.end_tokens, setup.stop_token_ids)


# -- response shapes ------------------------------------------------------------------------------


def message_body(message: ChatMessage) -> dict[str, Any]:
    """`choices[0].message` of a whole response."""
    body: dict[str, Any] = {"role": "assistant", "content": message.content or (None if message.tool_calls else "")}
    if message.reasoning:
        body["reasoning_content"] = message.reasoning
    if message.tool_calls:
        body["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return body


def delta_body(delta: ChatDelta) -> dict[str, Any]:
    """`choices[0].delta` of a streamed chunk: only the fields this delta adds."""
    body: dict[str, Any] = {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    calls: list[dict[str, Any]] = []
    for d in delta.tool_calls:
        if calls and calls[-1]["index"] == d.index:  # one entry per call per chunk
            calls[-1]["function"]["arguments"] += d.arguments
        elif d.id is None:
            calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        else:
            function = {"name": d.name, "arguments": d.arguments}
            calls.append({"index": d.index, "id": d.id, "type": "function", "function": function})
    if calls:
        body["tool_calls"] = calls
    return body
