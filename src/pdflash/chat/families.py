"""Chat families: which output parser a model's turns go through, and how a tool call is forced.

Owns the registry `FAMILIES` (name -> ChatFamily) and the choice of a family for a chat
template (`--chat-parser auto` picks the first family whose markers the template uses).
A family bundles what differs between model lines: the parser that splits a turn into
reasoning, content and tool calls, and the text that, appended to the prompt, makes the
turn start with a tool call (how `tool_choice: "required"` or a named function is
enforced), and the special tokens that end a turn whatever the checkpoint's EOS list says
(harmony's `<|call|>`). `qwen3` is Qwen3's `<think>` reasoning plus hermes `<tool_call>`
blocks; `harmony` is gpt-oss's channels with tool calls on `commentary`. Must not render
templates or know the HTTP wire format.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence

import attrs

from pdflash.chat.deltas import EMPTY, ChatDelta, OutputParser, PlainOutput
from pdflash.chat.harmony import CALL
from pdflash.chat.harmony_calls import FUNCTIONS, HarmonyChannels
from pdflash.chat.reasoning import CONTENT, REASONING, START, ThinkReasoning
from pdflash.chat.tool_parsers import HermesToolCalls


@attrs.frozen(kw_only=True)
class ToolChoice:
    """A request's `tool_choice`: "auto", "none", "required", or one named function."""

    mode: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the function, for mode "function"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


AUTO = ToolChoice(mode="auto")


@attrs.frozen(kw_only=True)
class TurnSetup:
    """What a family's parser needs to know about one turn."""

    prompt: str  # the rendered prompt (before any forcing prefix)
    tool_names: frozenset[str] | None  # functions offered; None: tool calls are not parsed
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    streaming: bool = True  # False: whole response, every block validated before it is emitted
    new_id: Callable[[], str] = attrs.field(default=lambda: "call_" + uuid.uuid4().hex[:24])


@attrs.frozen(kw_only=True)
class ChatFamily:
    name: str
    detect: Callable[[str], bool]  # does a chat template's source use this family's markers
    new_parser: Callable[[TurnSetup], OutputParser]
    forcing_prefix: Callable[[str, ToolChoice], str] | None  # (prompt, choice) -> text; None: no tool calls
    summary: str  # one line for --help and the docs
    stop_markers: tuple[str, ...] = ()  # special tokens that end the turn (added to the request's stop ids)

    @property
    def parses_tool_calls(self) -> bool:
        return self.forcing_prefix is not None


# -- qwen3 ---------------------------------------------------------------------------------------


class ReasoningThenTools:
    """A reasoning parser whose content goes on through a tool-call parser (or none)."""

    def __init__(self, reasoning: ThinkReasoning, tools: HermesToolCalls | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatDelta:
        return self._split(*self.reasoning.feed(text))

    def finish(self) -> ChatDelta:
        delta = self._split(*self.reasoning.finish())
        if self.tools is None:
            return delta
        content, calls = self.tools.finish()
        return delta + ChatDelta(content=content, tool_calls=tuple(calls))

    def _split(self, reasoning: str, content: str) -> ChatDelta:
        if self.tools is None or not content:
            return ChatDelta(reasoning=reasoning, content=content) if reasoning or content else EMPTY
        content, calls = self.tools.feed(content)
        return ChatDelta(reasoning=reasoning, content=content, tool_calls=tuple(calls))


def _qwen3_parser(setup: TurnSetup) -> OutputParser:
    prompt = setup.prompt
    if prompt.endswith("</think>\n\n"):
        state = CONTENT  # enable_thinking false: the template closed an empty think block
    elif prompt.rstrip("\n").endswith("<think>"):
        state = REASONING  # the template opened the think block
    else:
        state = START
    tools = (
        None
        if setup.tool_names is None
        else HermesToolCalls(
            setup.tool_names, new_id=setup.new_id, streaming=setup.streaming, max_calls=setup.max_calls
        )
    )
    return ReasoningThenTools(ThinkReasoning(state=state), tools)


def _qwen3_forcing_prefix(prompt: str, choice: ToolChoice) -> str:
    """The turn opens with a tool call: after an empty think block, `<tool_call>` (and the name)."""
    think = "" if prompt.endswith("</think>\n\n") else "<think>\n\n</think>\n\n"
    head = "<tool_call>\n"
    if choice.mode == "function":
        head += '{"name": ' + json.dumps(choice.name, ensure_ascii=False) + ', "arguments": '
    return think + head


QWEN3 = ChatFamily(
    name="qwen3",
    detect=lambda source: "<tool_call>" in source or "<think>" in source,
    new_parser=_qwen3_parser,
    forcing_prefix=_qwen3_forcing_prefix,
    summary="<think>…</think> → reasoning_content; hermes <tool_call>{json}</tool_call> → tool_calls",
)

PLAIN = ChatFamily(
    name="plain",
    detect=lambda source: False,
    new_parser=lambda setup: PlainOutput(),
    forcing_prefix=None,
    summary="all text is content; no reasoning or tool-call parsing",
)

# -- harmony (gpt-oss) -----------------------------------------------------------------------------


def _harmony_parser(setup: TurnSetup) -> OutputParser:
    return HarmonyChannels(setup.tool_names, new_id=setup.new_id, streaming=setup.streaming, max_calls=setup.max_calls)


def _harmony_forcing_prefix(prompt: str, choice: ToolChoice) -> str:
    """After the prompt's `<|start|>assistant`, a commentary header addressed to a function (or the named one)."""
    head = "<|channel|>commentary to=" + FUNCTIONS
    if choice.mode == "function":
        head += f"{choice.name} <|constrain|>json<|message|>"
    return head


HARMONY = ChatFamily(
    name="harmony",
    detect=lambda source: "<|channel|>" in source,
    new_parser=_harmony_parser,
    forcing_prefix=_harmony_forcing_prefix,
    summary="gpt-oss harmony: analysis → reasoning_content, other channels → content; "
    "commentary to=functions.NAME → tool_calls",
    stop_markers=(CALL,),
)

FAMILIES: dict[str, ChatFamily] = {f.name: f for f in (QWEN3, HARMONY, PLAIN)}


def register(family: ChatFamily) -> None:
    """Add a family: `register(ChatFamily(name=..., detect=lambda source: "<marker>" in source,
    new_parser=..., forcing_prefix=..., summary=...))`, as `qwen3` and `harmony` are. Its parser gets
    token ids with the text (`OutputParser.feed`); auto detection tries families in
    registration order (`plain` never matches)."""
    FAMILIES[family.name] = family


def family_for(name: str, template_source: str | None) -> ChatFamily:
    """The family `--chat-parser NAME` names; "auto": the first whose markers the template uses."""
    if name == "auto":
        found = (f for f in FAMILIES.values() if template_source is not None and f.detect(template_source))
        return next(found, PLAIN)
    if name not in FAMILIES:
        raise ValueError(f"--chat-parser {name!r} is not a chat family; choose auto or one of {sorted(FAMILIES)}")
    return FAMILIES[name]
