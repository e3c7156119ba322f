"""Reasoning parsers: the model's thinking split from its answer, as the text streams.

Owns `ThinkReasoning`, the `<think>…</think>` form Qwen3 writes (vLLM's `qwen3` reasoning
parser): reasoning is what lies between the tags at the start of the turn, the answer is
what follows. The newlines the template itself puts inside the tags and after them are
not part of either (Qwen3's template re-renders `reasoning.strip('\\n')` and
`content.lstrip('\\n')`, so a returned message renders back to the same prompt text).
Must not look at tool calls: content goes on to the tool parser.
"""

from __future__ import annotations

from pdflash.chat.deltas import marker_prefix_len

START, REASONING, CONTENT = "start", "reasoning", "content"


class ThinkReasoning:
    """`<think>reasoning</think>content` → (reasoning, content) pieces, streaming.

    `state`: "start" (the turn may open with `<think>`), "reasoning" (the prompt already
    opened the tag, as thinking-only templates do) or "content" (the prompt closed an empty
    think block: Qwen3 with `enable_thinking: false`). A `<think>` only counts at the start
    of the turn; one that never closes (the turn ran out of tokens) is all reasoning.
    """

    def __init__(self, *, state: str = START, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        if state not in (START, REASONING, CONTENT):
            raise ValueError(f"state={state!r} is invalid: use {START!r}, {REASONING!r} or {CONTENT!r}")
        self.state = state
        self.open_tag, self.close_tag = open_tag, close_tag
        self._buf = ""  # text received and not yet given out
        self._strip_newlines = state == REASONING  # leading newlines of the current part are the template's

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        self._buf += text
        reasoning, content = "", ""
        while self._buf:
            if self.state == START:
                lead = self._buf.lstrip()
                if lead.startswith(self.open_tag):
                    self._buf, self.state, self._strip_newlines = lead[len(self.open_tag) :], REASONING, True
                    continue
                if self.open_tag.startswith(lead):
                    break  # still maybe `<think>`
                self.state = CONTENT
            elif self.state == REASONING:
                if not self._skip_leading_newlines():
                    break
                end = self._buf.find(self.close_tag)
                if end >= 0:
                    reasoning += self._buf[:end].rstrip("\n")
                    self._buf = self._buf[end + len(self.close_tag) :]
                    self.state, self._strip_newlines = CONTENT, True
                    continue
                body = self._buf[: len(self._buf) - marker_prefix_len(self._buf, self.close_tag)]
                body = body.rstrip("\n")  # newlines right before `</think>` are the template's: hold them
                reasoning += body
                self._buf = self._buf[len(body) :]
                break
            else:
                if not self._skip_leading_newlines():
                    break
                content += self._buf
                self._buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back: an unclosed think block is reasoning, anything else content."""
        rest, self._buf = self._buf, ""
        if self.state == REASONING:
            return rest, ""
        if self.state == CONTENT and self._strip_newlines:
            rest = rest.lstrip("\n")
        return "", rest

    def _skip_leading_newlines(self) -> bool:
        """Drop the template's newlines at the start of a part; False while nothing else has come."""
        if self._strip_newlines:
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return False
            self._strip_newlines = False
        return True
