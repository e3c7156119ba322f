"""Harmony (gpt-oss) output split into channels: `final` is the reply, `analysis` the reasoning.

The model writes messages as `<|channel|>NAME<|message|>TEXT<|end|>` (after the prompt's
`<|start|>assistant`; later messages repeat `<|start|>assistant`), ending its turn with
`<|return|>` or `<|call|>`. As vLLM does, text of the `analysis` channel becomes
`reasoning_content` and every other channel's text `content`; headers and markers are dropped.
The splitter is incremental: deltas may cut a marker anywhere, and it holds back only what
could still be the start of one.
"""

from __future__ import annotations

import attrs

MESSAGE, CHANNEL = "<|message|>", "<|channel|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKER_MAX_CHARS = 16  # longer than any harmony marker ("<|constrain|>" is 13)
REASONING_CHANNEL = "analysis"


def speaks_harmony(tokenizer) -> bool:
    """True for a tokenizer with the harmony message markers (gpt-oss's)."""
    return tokenizer is not None and all(tokenizer.token_id(m) is not None for m in (CHANNEL, MESSAGE, "<|end|>"))


@attrs.frozen
class ChannelDelta:
    reasoning: bool  # analysis channel (reasoning_content) or any other (content)
    text: str


class ChannelSplitter:
    """Feed decoded text deltas; get (reasoning?, text) pieces of message bodies in order."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified (may end in part of a marker)
        self._header = ""  # the current message's header so far
        self._reasoning: bool | None = None  # None: in a header; else the body's channel kind

    def feed(self, text: str) -> list[ChannelDelta]:
        self._pending += text
        out: list[ChannelDelta] = []
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

    def finish(self) -> list[ChannelDelta]:
        """What is left at the end of the stream (a body cut short by a length limit, say)."""
        out: list[ChannelDelta] = []
        self._plain(self._pending, out)
        self._pending = ""
        return out

    def _plain(self, text: str, out: list[ChannelDelta]) -> None:
        if not text:
            return
        if self._reasoning is None:
            self._header += text
        else:
            out.append(ChannelDelta(self._reasoning, text))

    def _marker(self, marker: str, out: list[ChannelDelta]) -> None:
        if self._reasoning is not None:  # in a body
            if marker in MESSAGE_ENDS:
                self._reasoning, self._header = None, ""
            else:
                out.append(ChannelDelta(self._reasoning, marker))
        elif marker == MESSAGE:
            self._reasoning = _channel(self._header) == REASONING_CHANNEL
        else:
            self._header += marker


def split_channels(text: str) -> tuple[str, str]:
    """(content, reasoning_content) of a whole harmony completion."""
    splitter = ChannelSplitter()
    pieces = splitter.feed(text) + splitter.finish()
    return (
        "".join(p.text for p in pieces if not p.reasoning),
        "".join(p.text for p in pieces if p.reasoning),
    )


def _channel(header: str) -> str:
    """The channel a header names (`...<|channel|>analysis`, `<|channel|>commentary to=x <|constrain|>json`)."""
    if CHANNEL not in header:
        return "final"
    name = header.split(CHANNEL, 1)[1].split("<|", 1)[0].split()
    return name[0] if name else "final"


def _merged(pieces: list[ChannelDelta]) -> list[ChannelDelta]:
    merged: list[ChannelDelta] = []
    for piece in pieces:
        if merged and merged[-1].reasoning == piece.reasoning:
            merged[-1] = ChannelDelta(piece.reasoning, merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged
