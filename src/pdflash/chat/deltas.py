"""What a chat turn's output parses into, and the interface every family's output parser has.

Owns the value types — `ChatDelta` (new reasoning, content and tool-call pieces) and the
assembled `ChatMessage` — and the `OutputParser` protocol: text (and its token ids) in,
deltas out, with `finish()` flushing what was held back. A whole response is the sum of
a stream's deltas, so streamed and whole responses cannot disagree. Must not know any
wire format (OpenAI bodies are built in `pdflash.server.chat`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs


@attrs.frozen(kw_only=True)
class ToolCallDelta:
    """The next piece of one tool call."""

    index: int  # the call's position among this turn's calls
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next characters of the arguments' JSON text


@attrs.frozen(kw_only=True)
class ChatDelta:
    """What one piece of model output adds to the assistant message."""

    reasoning: str = ""  # reasoning text (e.g. inside <think>…</think>)
    content: str = ""  # the visible answer
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: ChatDelta) -> ChatDelta:
        return ChatDelta(
            reasoning=self.reasoning + later.reasoning,
            content=self.content + later.content,
            tool_calls=self.tool_calls + later.tool_calls,
        )


EMPTY = ChatDelta()


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@attrs.frozen(kw_only=True)
class ChatMessage:
    """The whole assistant message: every delta of a turn, assembled."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]

    @classmethod
    def assemble(cls, deltas: Iterable[ChatDelta]) -> ChatMessage:
        total = sum(deltas, EMPTY)
        calls: dict[int, dict[str, str]] = {}
        for d in total.tool_calls:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] = d.name or call["name"]
            call["arguments"] += d.arguments
        return cls(
            reasoning=total.reasoning,
            content=total.content,
            tool_calls=tuple(ToolCall(**calls[i]) for i in sorted(calls)),
        )


class OutputParser(Protocol):
    """Splits a turn's generated text into reasoning, content and tool calls, as it streams."""

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatDelta:
        """The delta `text` (decoded from `token_ids`) completes; may hold back an undecided tail."""
        ...

    def finish(self) -> ChatDelta:
        """Everything still held back, once the turn has ended."""
        ...


class PlainOutput:
    """No parsing: all text is content (templates without reasoning or tool markers)."""

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatDelta:
        return ChatDelta(content=text) if text else EMPTY

    def finish(self) -> ChatDelta:
        return EMPTY


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (text a parser must hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
