"""One request inside the engine: its lifecycle state machine, its session and its counters.

Owns the lifecycle (one shared `transitions.Machine`, triggers for lifecycle edges only)
and what a sequence has streamed. Must not touch scheduling or model work: the engine decides when
a trigger fires and runs the rounds.

    WAITING -schedule-> PREFILL -prefilled-> DRAFT -drafted-> VERIFY -verified-> DRAFT ...
    PREFILL | VERIFY -finish-> FINISHED;  any live state -abort-> ABORTED | -fail-> FAILED

Without a drafter the machine is the same: DRAFT makes a block of one token (the anchor,
no drafter forward) and VERIFY decodes it, so plain decoding is speculation with B = 1.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from transitions import Machine

from pdflash.engine.outputs import OutputMailbox, RequestMetrics, RequestOutput, TextStream
from pdflash.engine.ticket import Ticket
from pdflash.sampling import SamplingParams
from pdflash.spec.acceptance import SequenceAcceptance
from pdflash.spec.policy import VerifyCut
from pdflash.spec.session import DraftResult, SpecSession, VerifyResult
from pdflash.spec.shadow import ShadowReader


class SequenceState(enum.Enum):
    WAITING = "waiting"  # queued, no KV yet
    PREFILL = "prefill"  # its prompt is being prefilled
    DRAFT = "draft"  # needs a drafted block for its next round
    VERIFY = "verify"  # its block awaits admission or is being verified
    FINISHED = "finished"
    ABORTED = "aborted"  # the client cancelled or went away
    FAILED = "failed"  # an error confined to this sequence


S = SequenceState
LIVE_STATES = frozenset({S.WAITING, S.PREFILL, S.DRAFT, S.VERIFY})


# One machine for every sequence: add_model on creation (it binds the triggers schedule,
# prefilled, drafted, verified, finish, abort and fail onto the instance), remove_model on exit.
LIFECYCLE = Machine(
    model=None,
    states=SequenceState,
    initial=S.WAITING,
    transitions=[
        {"trigger": "schedule", "source": S.WAITING, "dest": S.PREFILL},
        {"trigger": "prefilled", "source": S.PREFILL, "dest": S.DRAFT},
        {"trigger": "drafted", "source": S.DRAFT, "dest": S.VERIFY},
        {"trigger": "verified", "source": S.VERIFY, "dest": S.DRAFT},
        {"trigger": "finish", "source": [S.PREFILL, S.VERIFY], "dest": S.FINISHED, "after": "_leave_lifecycle"},
        {"trigger": "abort", "source": list(LIVE_STATES), "dest": S.ABORTED, "after": "_leave_lifecycle"},
        {"trigger": "fail", "source": list(LIVE_STATES), "dest": S.FAILED, "after": "_leave_lifecycle"},
    ],
    auto_transitions=False,
    ignore_invalid_triggers=False,
)


@attrs.define(slots=False, eq=False)
class Sequence:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    text: TextStream
    mailbox: OutputMailbox = attrs.Factory(OutputMailbox)
    arrival_s: float = attrs.Factory(time.perf_counter)  # perf_counter seconds
    session: SpecSession | None = None  # set by prefill; released on exit
    state: SequenceState = attrs.field(init=False, default=S.WAITING)  # owned by LIFECYCLE
    # hot counters: plain attributes, never triggers
    streamed: int = 0  # tokens streamed to the client
    acceptance_lengths: list[int] = attrs.Factory(list)  # per verify round
    block_sizes: list[int] = attrs.Factory(list)  # tokens verified per round (the policy's choice)
    acceptance: SequenceAcceptance | None = None  # its acceptance estimates (adaptive speculation)
    planned_block: int = 1  # tokens its next verify holds, anchor included
    planned_draft: int = 1  # tokens the drafter makes for it (>= planned_block; 1: no drafter forward)
    planned_cut: VerifyCut | None = None  # how its drafts are cut once made (None: the planned block stands)
    # its drafts no verify read, read against the tokens it commits (pdflash.spec.shadow)
    shadow: ShadowReader = attrs.Factory(ShadowReader)
    expected_tokens: float = 1.0  # its pending verify's E[committed]: by its drafts' confidence, else its mean estimate
    expert_bytes: int = 0  # Σ projected union bytes over its verifies
    fetch_bytes: int = 0  # Σ non-resident part of those
    first_token_at: float | None = None
    prefill_held: bool = False  # its seat waited for a sequence about to leave (pdflash.engine.seating)
    drafted_at: float = 0.0  # perf_counter seconds when its pending demand was registered
    verified_at: float = 0.0  # perf_counter seconds when its last verify ended (0: none yet)
    admission_wait_s: float = 0.0
    ticket: Ticket | None = None  # admission ticket of its pending verify demand
    verify_done: anyio.Event = attrs.Factory(anyio.Event)  # its admitted verify ended (a new one per round)
    verify_result: VerifyResult | None = None  # what that verify returned
    verify_error: BaseException | None = None  # or what it raised
    claim: Any = None  # the cache's claim on its prefetched union (released after its verify or exit)
    anchor_claim: Any = None  # the cache's claim on its next anchor's experts (until that round's verify ran)
    scope: anyio.CancelScope | None = None  # its coroutine's, cancelled by an abort
    draft: DraftResult | None = None  # its pending verify's drafted block and projected union
    released: anyio.Event = attrs.Factory(anyio.Event)  # KV, demand and claims given back

    if TYPE_CHECKING:  # the triggers LIFECYCLE.add_model binds onto each instance

        def schedule(self) -> bool: ...
        def prefilled(self) -> bool: ...
        def drafted(self) -> bool: ...
        def verified(self) -> bool: ...
        def finish(self) -> bool: ...
        def abort(self) -> bool: ...
        def fail(self) -> bool: ...

    def __attrs_post_init__(self) -> None:
        LIFECYCLE.add_model(self)

    def _leave_lifecycle(self) -> None:
        LIFECYCLE.remove_model(self)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def kv_bytes(self) -> int:
        """Target + drafter KV cache bytes its session holds."""
        return self.session.kv_bytes if self.session is not None else 0

    def stream(self, token_ids: tuple[int, ...] | list[int], finish_reason: str | None) -> None:
        """Send a round's tokens (already cut where the request ends) and, once it has, its finish reason."""
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.streamed += len(token_ids)
        self._put(tuple(token_ids), finish_reason)

    def close_stream(self, finish_reason: str) -> None:
        """Send the last delta of a sequence that ends without new tokens (an abort)."""
        self._put((), finish_reason)

    def _put(self, token_ids: tuple[int, ...], finish_reason: str | None) -> None:
        final = finish_reason is not None
        logprobs = self.session.logprobs if self.session is not None else []
        first = self.streamed - len(token_ids)  # session.logprobs runs parallel to the streamed tokens
        self.mailbox.put(
            RequestOutput(
                request_id=self.request_id,
                token_ids=token_ids,
                logprobs=tuple(logprobs[first : first + len(token_ids)]),
                text=self.text.take(final),
                finished=final,
                finish_reason=finish_reason,
                metrics=self.metrics(final),
            )
        )

    def metrics(self, final: bool = False) -> RequestMetrics:
        return RequestMetrics(
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=self.streamed,
            acceptance_lengths=tuple(self.acceptance_lengths),
            block_sizes=tuple(self.block_sizes),
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.arrival_s,
            expert_bytes=self.expert_bytes,
            fetch_bytes=self.fetch_bytes,
            admission_wait_s=self.admission_wait_s,
            session_stats=self.session.stats() if final and self.session is not None else None,
        )
