"""The chat OutputParser of the harmony family: channels, and tool calls on `commentary`.

Owns `HarmonyChannels`. As vLLM does, the `analysis` channel's text becomes
`reasoning_content` and every other channel's text `content`; headers and markers are
dropped. A `commentary` message addressed `to=functions.NAME`, NAME among the request's
tools, is a tool call whose body is the arguments' JSON object. A call to any other
recipient, or whose body is not a JSON object, is given back as plain content (its body).
Streaming announces a call (id, name) once its body opens with `{` and then streams the
arguments' text as the model writes it (a call announced cannot be taken back, as with
hermes); whole responses (`streaming=False`) validate every body before emitting it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence

from pdflash.chat.deltas import EMPTY, ChatDelta, ToolCallDelta
from pdflash.chat.harmony import Event, Header, MessageScanner
from pdflash.chat.tool_parsers import LiveArguments

FUNCTIONS = "functions."  # the namespace the harmony template puts the request's tools in
CALL_CHANNEL = "commentary"


class HarmonyChannels:
    """Harmony text in → reasoning, content and tool-call deltas out.

    `tool_names`: the functions the request offered (None: no tool calls are parsed).
    `max_calls`: calls kept (1 for `parallel_tool_calls: false`); later valid ones are dropped.
    """

    def __init__(
        self,
        tool_names: frozenset[str] | None = None,
        *,
        new_id: Callable[[], str] = lambda: "call_" + uuid.uuid4().hex[:24],
        streaming: bool = True,
        max_calls: int | None = None,
    ) -> None:
        self.tool_names, self.new_id, self.streaming, self.max_calls = tool_names, new_id, streaming, max_calls
        self.calls = 0  # calls emitted (or announced) so far
        self._scanner = MessageScanner()
        self._reasoning = False  # the open body is analysis text
        self._call: _CallBody | None = None  # the open body is a tool call's

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ChatDelta:
        return self._apply(self._scanner.feed(text))

    def finish(self) -> ChatDelta:
        """A body the turn left open (its `<|call|>` was the stop token, say) is closed as it stands."""
        return self._apply([*self._scanner.finish(), Event("end", "")])

    def _apply(self, events: list[Event]) -> ChatDelta:
        delta = EMPTY
        for event in events:
            if event.kind == "header":
                header = Header.parse(event.text)
                self._reasoning, self._call = header.reasoning, self._call_for(header)
            elif event.kind == "body":
                delta += self._call.feed(event.text, self) if self._call is not None else self._text(event.text)
            elif self._call is not None:
                call, self._call = self._call, None
                delta += call.close(self)
        return delta

    def _text(self, text: str) -> ChatDelta:
        return ChatDelta(reasoning=text) if self._reasoning else ChatDelta(content=text)

    def _call_for(self, header: Header) -> _CallBody | None:
        recipient = header.recipient or ""
        if self.tool_names is None or header.channel != CALL_CHANNEL or not recipient.startswith(FUNCTIONS):
            return None
        name = recipient.removeprefix(FUNCTIONS)
        return _CallBody(name) if name in self.tool_names else None

    def announce(self, name: str, arguments: str = "") -> ToolCallDelta | None:
        """Number and name the next call; None once `max_calls` calls were kept."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return None
        index, self.calls = self.calls, self.calls + 1
        return ToolCallDelta(index=index, id=self.new_id(), name=name, arguments=arguments)


class _CallBody:
    """The body of a message addressed to one of the request's functions."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.text = ""  # the body so far
        self.live: LiveArguments | None = None  # announced: its arguments are streaming
        self.dropped = False  # announced past max_calls: the body goes nowhere
        self.buffered = False  # cannot be streamed (no `{` first): judged once it ends

    def feed(self, text: str, parser: HarmonyChannels) -> ChatDelta:
        self.text += text
        if self.live is not None:
            return ChatDelta(tool_calls=tuple(self.live.arguments(self.text)))
        if not parser.streaming or self.buffered or self.dropped:
            return EMPTY
        lead = self.text.lstrip()
        if not lead:
            return EMPTY
        if not lead.startswith("{"):
            self.buffered = True
            return EMPTY
        first = parser.announce(self.name)
        if first is None:
            self.dropped = True
            return EMPTY
        self.live = LiveArguments(index=first.index, start=len(self.text) - len(lead))
        return ChatDelta(tool_calls=(first, *self.live.arguments(self.text)))

    def close(self, parser: HarmonyChannels) -> ChatDelta:
        if self.live is not None or self.dropped:
            return EMPTY  # what was announced stands, whatever followed
        arguments = self.text.strip()
        if not _is_object(arguments):
            return ChatDelta(content=self.text)  # not a call after all: the model's text, as content
        call = parser.announce(self.name, arguments)
        return EMPTY if call is None else ChatDelta(tool_calls=(call,))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
