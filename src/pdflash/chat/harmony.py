"""Harmony (gpt-oss) output read as messages: a header, then a body, then an end marker.

The model writes messages as `<|channel|>NAME<|message|>TEXT<|end|>` (after the prompt's
`<|start|>assistant`; later messages repeat `<|start|>assistant`), ending its turn with
`<|return|>` or, after a tool call, `<|call|>`. A tool call is a `commentary` message whose
header names a recipient: `<|channel|>commentary to=functions.NAME <|constrain|>json`
(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME`).
Owns `MessageScanner`, which turns a stream of decoded text into header / body / end
events (holding back only what could still be the start of a marker), `Header`, what a
header says, and `split_channels`, the plain reasoning / content split of a completion.
The chat parser built on these events, with the tool calls, is `harmony_calls`.
"""

from __future__ import annotations

from typing import Literal

import attrs

MESSAGE, CHANNEL, CONSTRAIN = "<|message|>", "<|channel|>", "<|constrain|>"
CALL = "<|call|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", CALL)
MARKER_MAX_CHARS = 16  # longer than any harmony marker ("<|constrain|>" is 13)
REASONING_CHANNEL = "analysis"


def speaks_harmony(tokenizer) -> bool:
    """True for a tokenizer with the harmony message markers (gpt-oss's)."""
    return tokenizer is not None and all(tokenizer.token_id(m) is not None for m in (CHANNEL, MESSAGE, "<|end|>"))


@attrs.frozen
class Header:
    """What a message's header says: its channel and, for a tool call, its recipient."""

    channel: str  # "final" when the header names none
    recipient: str | None  # e.g. "functions.get_weather"; None: the message is for the user

    @classmethod
    def parse(cls, text: str) -> Header:
        """`<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json` and the like."""
        role_part, _, channel_part = text.partition(CHANNEL)
        channel_words = channel_part.replace(CONSTRAIN, " ").split()
        words = role_part.split() + channel_words[1:]
        recipient = next((w.removeprefix("to=") for w in words if w.startswith("to=")), None)
        return cls(channel=channel_words[0] if channel_words else "final", recipient=recipient or None)

    @property
    def reasoning(self) -> bool:
        return self.channel == REASONING_CHANNEL


@attrs.frozen
class Event:
    kind: Literal["header", "body", "end"]
    text: str  # the header's text, the next body text, or the end marker


class MessageScanner:
    """Feed decoded text deltas; get the header, body and end events of its messages in order."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified (may end in part of a marker)
        self._header = ""  # the current message's header so far
        self._in_body = False

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while self._pending:
            start = self._pending.find("<|")
            if start < 0:
                keep = 1 if self._pending.endswith("<") else 0
                self._plain(self._pending[: len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep :]
                break
            self._plain(self._pending[:start], out)
            self._pending = self._pending[start:]
            stop = self._pending.find("|>", 2, MARKER_MAX_CHARS)
            if stop < 0:
                if len(self._pending) < MARKER_MAX_CHARS:
                    break  # perhaps a marker cut by the delta: wait for more
                self._plain("<|", out)  # not a marker: literal text
                self._pending = self._pending[2:]
                continue
            marker, self._pending = self._pending[: stop + 2], self._pending[stop + 2 :]
            self._marker(marker, out)
        return _merged(out)

    def finish(self) -> list[Event]:
        """What is left at the end of the stream (a body cut short by a length limit, say)."""
        out: list[Event] = []
        self._plain(self._pending, out)
        self._pending = ""
        return out

    def _plain(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._in_body:
            out.append(Event("body", text))
        else:
            self._header += text

    def _marker(self, marker: str, out: list[Event]) -> None:
        if self._in_body:
            if marker in MESSAGE_ENDS:
                self._in_body, self._header = False, ""
                out.append(Event("end", marker))
            else:
                out.append(Event("body", marker))
        elif marker == MESSAGE:
            self._in_body = True
            out.append(Event("header", self._header))
        else:
            self._header += marker


def _merged(events: list[Event]) -> list[Event]:
    merged: list[Event] = []
    for event in events:
        if merged and merged[-1].kind == event.kind == "body":
            merged[-1] = Event("body", merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def split_channels(text: str) -> tuple[str, str]:
    """(content, reasoning_content) of a whole harmony completion: every body, headers dropped."""
    scanner = MessageScanner()
    content: list[str] = []
    reasoning: list[str] = []
    reasoning_body = False
    for event in scanner.feed(text) + scanner.finish():
        if event.kind == "header":
            reasoning_body = Header.parse(event.text).reasoning
        elif event.kind == "body":
            (reasoning if reasoning_body else content).append(event.text)
    return "".join(content), "".join(reasoning)
