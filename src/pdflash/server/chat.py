"""Chat requests on the wire: messages, tools, tool_choice and template kwargs in; parsed turns out.

Owns the chat-only request fields (validated with errors naming the field), rendering a
request into a prompt through the served chat template, the per-turn output parser (from
the model's chat family), and the OpenAI shapes of what it yields: `message` with
`reasoning_content` and `tool_calls`, streamed `delta`s with incremental `arguments`,
`finish_reason: "tool_calls"`, and the family's turn-ending tokens added to a chat request's
stop ids. Shared by the HTTP endpoint and the websocket. Must not touch the engine: a turn
reads the deltas `engine.generate()` yields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pdflash.chat.deltas import EMPTY, ChatDelta, ChatMessage, OutputParser
from pdflash.chat.families import AUTO, ChatFamily, ToolChoice, TurnSetup, family_for
from pdflash.chat.template import RESERVED_VARIABLES, ChatTemplate, ChatTemplateError
from pdflash.engine.outputs import RequestOutput
from pdflash.sampling import SamplingParams
from pdflash.server.errors import invalid

CHAT_FIELDS = {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "documents"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content", "reasoning", "thinking")


@attrs.frozen(kw_only=True)
class ChatRequest:
    """The chat part of a request, validated."""

    messages: list[dict[str, Any]]  # role, content as text, and tool_calls / tool_call_id / name / reasoning
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, as sent (the template renders them)
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # chat_template_kwargs, e.g. enable_thinking
    documents: list[dict[str, Any]] | None = None


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


# -- request fields -------------------------------------------------------------------------------


def parse_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    tools = parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {json.dumps(parallel)}", param="parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid(
            f'chat_template_kwargs must be an object like {{"enable_thinking": false}}, got {json.dumps(kwargs)[:200]}',
            param="chat_template_kwargs",
        )
    reserved = sorted(RESERVED_VARIABLES & set(kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs cannot set {reserved[0]!r}: it comes from the request's own field",
            param=f"chat_template_kwargs.{reserved[0]}",
        )
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise invalid(f"documents must be an array of objects, got {json.dumps(documents)[:200]}", param="documents")
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=True if parallel is None else parallel,
        template_kwargs=kwargs,
        documents=documents,
    )


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise invalid(
            f"messages must be a non-empty array of {{role, content}} objects, got {json.dumps(value)[:200]}",
            param="messages",
        )
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise invalid(
            f"messages[{i}] must be an object with a role in {list(CHAT_ROLES)}, got {json.dumps(message)[:200]}",
            param=f"messages[{i}].role",
        )
    out: dict[str, Any] = {"role": message["role"]}
    if message.get("content") is not None:  # a null content is left out, as transformers leaves it out
        out["content"] = _content(message["content"], i)
    for name in MESSAGE_TEXT_FIELDS:
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise invalid(
                    f"messages[{i}].{name} must be a string, got {json.dumps(message[name])[:200]}",
                    param=f"messages[{i}].{name}",
                )
            out[name] = message[name]
    if message.get("tool_calls") is not None:
        if message["role"] != "assistant":
            raise invalid(
                f"messages[{i}] has tool_calls but role {message['role']!r}; only assistant messages carry tool calls",
                param=f"messages[{i}].tool_calls",
            )
        out["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(_array(message["tool_calls"], i))]
    return out


def _array(value: Any, i: int) -> list:
    if not isinstance(value, list):
        raise invalid(
            f"messages[{i}].tool_calls must be an array, got {json.dumps(value)[:200]}",
            param=f"messages[{i}].tool_calls",
        )
    return value


def _tool_call(call: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    ok = (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), (str, dict))
    )
    if not ok:
        raise invalid(
            f'{where} must be {{"id", "type": "function", "function": {{"name": string, "arguments": JSON text}}}}, '
            f"got {json.dumps(call)[:200]}",
            param=where,
        )
    return call


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or an array of {"type": "text", "text": ...} parts joined."""
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


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid(f"tools must be an array of function tools, got {json.dumps(value)[:200]}", param="tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        ok = (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
            and isinstance(function.get("parameters", {}), dict)
        )
        if not ok:
            raise invalid(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": non-empty string, '
                f'"description": string, "parameters": JSON schema object}}}}, got {json.dumps(tool)[:200]}',
                param=f"tools[{i}]",
            )
    return value or None


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    names = [t["function"]["name"] for t in tools or []]
    if value is None:
        return AUTO if tools else ToolChoice(mode="none")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(mode=value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = ToolChoice(mode="function", name=value["function"].get("name"))
        if choice.name not in names:
            raise invalid(
                f"tool_choice names the function {json.dumps(choice.name)}, which is not among the tools {names}",
                param="tool_choice",
            )
    else:
        raise invalid(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(value)[:200]}",
            param="tool_choice",
        )
    if choice.forced and not tools:
        raise invalid(f"tool_choice {json.dumps(value)} needs tools, and the request has none", param="tool_choice")
    return choice


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
