"""What a request streams back: output deltas, their metrics, the text stream and the mailbox.

Owns the per-request output path after the model: incremental detokenization (partial
UTF-8 held back), stop strings applied on the text, and a non-blocking mailbox that merges
deltas so a slow consumer never stalls the engine loop. Must not touch sequence state or
model work: the engine pushes token ids in and reads text and finish decisions out.
"""

from __future__ import annotations

import anyio
import attrs

from pdflash.sampling import TokenLogprob
from pdflash.target.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


@attrs.frozen(kw_only=True)
class RequestMetrics:
    """Per-request counters, as of the delta that carries them."""

    prompt_tokens: int  # tokens in the prompt
    generated_tokens: int  # tokens streamed so far (prompt excluded)
    acceptance_lengths: tuple[int, ...]  # tokens emitted per verify round, bonus included
    block_sizes: tuple[int, ...]  # tokens verified per round: the speculation policy's choices
    ttft_s: float | None  # arrival -> first token, seconds; None before it
    expert_bytes: int  # Σ projected expert-union bytes of its verify rounds
    fetch_bytes: int  # the part of expert_bytes not resident when projected
    admission_wait_s: float  # Σ time its drafted blocks waited for verify admission
    session_stats: dict | None = None  # the session's round stats (SpecSession.stats()); final delta only


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One delta of a request's stream: what is new since the previous delta."""

    request_id: str
    token_ids: tuple[int, ...]  # new token ids
    text: str  # new text ("" when the model has no tokenizer)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: RequestMetrics  # as of this delta
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asked for logprobs

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later`, as one delta."""
        return attrs.evolve(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
        )


class TextStream:
    """Incremental detokenization of one request with its stop strings (a `StopWatcher`).

    Text is released only up to a complete character (a token that ends inside a UTF-8
    sequence decodes to U+FFFD and waits for the next one) and, while unfinished, never
    into a suffix that could still grow into a stop string. A completed stop string cuts
    the text just before it. The request's `StopRule` feeds it every emitted token (on the
    lane that runs the round); the engine takes the text after the round.
    """

    def __init__(self, tokenizer: TextTokenizer | None, stop: tuple[str, ...]) -> None:
        if stop and tokenizer is None:
            raise ValueError(
                f"stop strings {list(stop)!r} need the model's tokenizer.json, which it lacks; "
                "use stop_token_ids instead"
            )
        self._tokenizer = tokenizer
        self._stop = stop
        self._longest_stop = max(map(len, stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` (context for the next decode)
        self._read = 0  # ids before this are in `text`
        self._sent = 0  # characters of `text` already released
        self.text = ""  # decoded text so far, cut at a stop string once one completes
        self.stopped = False  # a stop string completed

    def push(self, token_id: int) -> bool:
        """Add one token; True when it completes a stop string (later tokens are not wanted)."""
        self._ids.append(token_id)
        if self._tokenizer is None:
            return False
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return False  # inside a multi-byte character: wait for more tokens
        self._prefix, self._read = self._read, len(self._ids)
        return self._append(after[len(before) :])

    def mark(self) -> tuple:
        return (len(self._ids), self._prefix, self._read, self._sent, self.text, self.stopped)

    def rewind(self, mark: object) -> None:
        assert isinstance(mark, tuple)
        count, self._prefix, self._read, self._sent, self.text, self.stopped = mark
        del self._ids[count:]

    def take(self, final: bool) -> str:
        """Text not yet released; `final` flushes everything, incomplete characters included."""
        if self._tokenizer is None:
            return ""
        if final and not self.stopped and self._read < len(self._ids):
            before = self._tokenizer.decode(self._ids[self._prefix : self._read])
            self._append(self._tokenizer.decode(self._ids[self._prefix :])[len(before) :])
            self._read = len(self._ids)
        end = len(self.text) if final or self.stopped else len(self.text) - self._stop_prefix_len()
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _append(self, new_text: str) -> bool:
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new_text
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        return self.stopped

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(self.text), self._longest_stop - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


class OutputMailbox:
    """One request's outbox: `put` never blocks and merges into what the consumer has not read.

    The buffer is one merged delta, so it grows with the unread tokens of this request
    only (at most its max_tokens) and never with the number of engine steps.
    """

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = anyio.Event()

    def put(self, output: RequestOutput) -> None:
        self._pending = output if self._pending is None else self._pending.merge(output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (after any output not yet read)."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """Everything put since the last get, merged; raises the failure once that is drained."""
        while self._pending is None and self._error is None:
            self._ready = anyio.Event()
            await self._ready.wait()
        if self._pending is not None:
            output, self._pending = self._pending, None
            return output
        assert self._error is not None  # the loop above ends on output or an error
        raise self._error
