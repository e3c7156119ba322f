"""Tool-call parsers: function calls the model writes, pulled out of its answer as it streams.

Owns `HermesToolCalls`, the `<tool_call>{"name": …, "arguments": {…}}</tool_call>` form of
Qwen3 (and Qwen2.5, Hermes; vLLM's `hermes` parser). A block whose JSON is not an object
with a string `name` among the request's tools and object `arguments` is given back as
plain content, tags and all. Streaming announces a call (id, name) as soon as
`{"name": "…", "arguments": ` has arrived and then streams the arguments' text as the model
writes it; whole responses (`streaming=False`) validate every block before emitting it.
Must not look at reasoning: it sees only the answer's text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pdflash.chat.deltas import ToolCallDelta, marker_prefix_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SPACE = " \t\r\n"


class HermesToolCalls:
    """Content text in → (content, tool-call deltas) out.

    `tool_names`: the functions the request offered (a call to any other is content).
    `max_calls`: calls kept (1 for `parallel_tool_calls: false`); later valid ones are dropped.
    Whitespace that only separates content from calls (or calls from each other) is dropped,
    so a returned message renders back to the text the model wrote.
    """

    def __init__(
        self, tool_names: frozenset[str], *, new_id: Callable[[], str], streaming: bool, max_calls: int | None = None
    ) -> None:
        self.tool_names, self.new_id, self.streaming, self.max_calls = tool_names, new_id, streaming, max_calls
        self.calls = 0  # calls emitted (or announced) so far
        self._buf = ""  # outside a block: undecided text; inside: the block's text so far
        self._in_block = False
        self._space = ""  # trailing whitespace of the content, held until we know what follows
        self._live: LiveArguments | None = None  # the announced call whose arguments are streaming
        self._object: ValueEnd | None = None  # the open block's JSON object, once its `{` arrived
        self._buffered = False  # this block cannot be streamed: it is judged once it closes

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._in_block:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = marker_prefix_len(self._buf, OPEN)
                    content.append(self._content(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._content(self._buf[:start]))
                self._buf, self._in_block = self._buf[start + len(OPEN) :], True
                self._live, self._object, self._buffered = None, None, False
                continue
            if self.streaming:
                calls += self._stream()  # announce the call, send its arguments so far
            end = self._block_end()
            if end < 0:
                break
            block, self._buf, self._in_block = self._buf[:end], self._buf[end + len(CLOSE) :], False
            got_content, got_calls = self._close(block, f"{OPEN}{block}{CLOSE}")
            content.append(got_content)
            calls += got_calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """An unclosed block is judged as it stands (a streamed call keeps the arguments sent)."""
        if self._in_block:
            block, self._in_block = self._buf, False
            content, calls = self._close(block, OPEN + block)
        else:
            content, calls = self._content(self._buf), []
        held, self._buf, self._space = self._space, "", ""
        return content + ("" if self.calls else held), calls  # trailing space only separated calls

    # -- content --------------------------------------------------------------------------

    def _content(self, text: str) -> str:
        text = self._space + text
        kept = text.rstrip(_SPACE)
        self._space = text[len(kept) :]
        return kept

    def _call_index(self) -> int:
        """Number the next call; the whitespace before it only separated it from what came before."""
        index, self.calls, self._space = self.calls, self.calls + 1, ""
        return index

    # -- blocks ---------------------------------------------------------------------------

    def _block_end(self) -> int:
        """Where the block's `</tool_call>` starts, -1 if not yet: never inside a JSON string.

        A streaming call's close comes after its arguments; another block's after its JSON
        object once that is complete, else (the JSON is broken or still coming) at the first tag.
        """
        if self._live is not None:
            end = self._live.span.scan(self._buf)
            return -1 if end is None else self._buf.find(CLOSE, end)
        if self._object is None and (lead := self._buf.lstrip(_SPACE)).startswith("{"):
            self._object = ValueEnd(len(self._buf) - len(lead))
        end = self._object.scan(self._buf) if self._object is not None else None
        return self._buf.find(CLOSE, end or 0)

    def _close(self, block: str, raw: str) -> tuple[str, list[ToolCallDelta]]:
        if self._live is not None:  # announced: the rest of its arguments, whatever follows them
            live, self._live = self._live, None
            return "", live.arguments(block)
        parsed = parse_call(block)
        if parsed is None or parsed[0] not in self.tool_names:
            return self._content(raw), []
        if self.max_calls is not None and self.calls >= self.max_calls:
            self._space = ""
            return "", []
        name, arguments = parsed
        return "", [ToolCallDelta(index=self._call_index(), id=self.new_id(), name=name, arguments=arguments)]

    def _stream(self) -> list[ToolCallDelta]:
        """Deltas of the open block: its announcement once the head is in, then its arguments."""
        if self._live is not None:
            return self._live.arguments(self._buf)
        if self._buffered or (self.max_calls is not None and self.calls >= self.max_calls):
            return []
        head = scan_head(self._buf)
        if head is None:
            return []  # not enough text yet
        if head is False or head[0] not in self.tool_names or self._buf[head[1]] != "{":
            self._buffered = True
            return []
        name, start = head
        self._live = LiveArguments(index=self._call_index(), start=start)
        first = ToolCallDelta(index=self._live.index, id=self.new_id(), name=name)
        return [first, *self._live.arguments(self._buf)]


class LiveArguments:
    """An announced call: its arguments' span in the block text and how far it went out."""

    def __init__(self, *, index: int, start: int) -> None:
        self.index = index
        self.span = ValueEnd(start)  # the arguments object, from its `{`
        self.sent = start  # block text before this has gone out

    def arguments(self, block: str) -> list[ToolCallDelta]:
        """The arguments' text that `block` (the block so far) adds, up to their closing `}`."""
        upto = self.span.scan(block) or len(block)
        piece, self.sent = block[self.sent : upto], upto
        return [ToolCallDelta(index=self.index, arguments=piece)] if piece else []


class ValueEnd:
    """Where one JSON object or array that opens at `start` ends (brackets outside strings).

    Incremental: each `scan` of the growing text goes on from where the last one stopped.
    """

    def __init__(self, start: int) -> None:
        self.scanned = start  # text before this has been read
        self.end: int | None = None  # just past the closing bracket, once seen
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """The index just past the value's end, or None if it goes on past `text`."""
        if self.end is not None:
            return self.end
        for i in range(self.scanned, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.scanned = i + 1
                    return self.end
        self.scanned = len(text)
        return None


def scan_head(text: str) -> tuple[str, int] | Literal[False] | None:
    """Match `{"name": "<name>", "arguments": ` at the start of a block.

    (name, index of the arguments' first character) when it matches, False when the text
    cannot become this form, None when more text is needed to tell.
    """
    i = 0
    for part in ("{", '"name"', ":", None, ",", '"arguments"', ":"):
        while i < len(text) and text[i] in _SPACE:
            i += 1
        if i == len(text):
            return None
        if part is None:  # the name: a JSON string
            if text[i] != '"':
                return False
            end = _string_end(text, i)
            if end is None:
                return None
            try:
                name = json.loads(text[i:end])
            except json.JSONDecodeError:
                return False
            i = end
            continue
        piece = text[i : i + len(part)]
        if not part.startswith(piece):
            return False
        if len(piece) < len(part):
            return None
        i += len(part)
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return None if i == len(text) else (name, i)


def _string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string that opens at text[start], or None if it has not closed."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one block's text, or None if it is not a valid call.

    The arguments are the model's own text when the block has the canonical form (so a
    streamed call and a whole one agree), else re-serialized.
    """
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments: Any = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return (call["name"], arguments) if isinstance(decoded, dict) else None
    if not isinstance(arguments, dict):
        return None
    head = scan_head(block)
    if isinstance(head, tuple) and block[head[1]] == "{":
        end = ValueEnd(head[1]).scan(block)
        if end is not None and _loads(block[head[1] : end]) == arguments:
            return call["name"], block[head[1] : end]
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
