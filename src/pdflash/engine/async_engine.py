"""The async engine: requests in, one coroutine per sequence stepping through its rounds, outputs out.

Owns the request API, seats (backpressure), each sequence's coroutine (prefill, then draft ->
register its verify demand -> await admission -> await the verify -> stream, read aloud in
`_serve`), exits and failure isolation. Model work runs on lanes (pdflash.engine.lanes; what
they run, pdflash.engine.round_work); admission ticks and batched verifies are the pacer's
(pdflash.engine.pacer); the stats snapshot is pdflash.engine.stats'. Must not
touch admission arithmetic, round algorithms, model math or the expert cache; model assembly
is pdflash.engine.builder's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import torch

from pdflash.engine.builder import BUILD_OPTIONS, OffloadProvider, build_engine_parts
from pdflash.engine.config import EngineConfig
from pdflash.engine.lanes import BatchLane, Lane, drafter_has_own_lane, lane_threads
from pdflash.engine.outputs import RequestOutput, TextStream
from pdflash.engine.pacer import DerivedBudgets, VerifyPacer, drop_anchor_claim
from pdflash.engine.prefill_mode import prefill_waits_for_verify, prefills_ride_verifies
from pdflash.engine.requests import prompt_token_ids
from pdflash.engine.requests import sampling_params as request_sampling_params
from pdflash.engine.round_work import ROUND_ISOLATION, RoundWork
from pdflash.engine.seating import prefill_waits, seconds_to_limit
from pdflash.engine.sequence import Sequence, SequenceState
from pdflash.engine.speculation import RoutingShape, SpeculationPlanner
from pdflash.engine.stats import EngineStats, Totals, engine_stats
from pdflash.engine.ticket import AdmissionCancelled, Ticket
from pdflash.errors import EngineClosedError, EngineOverloadedError
from pdflash.measure import BusyClock
from pdflash.sampling import SamplingParams
from pdflash.spec.projection import Projection
from pdflash.spec.session import DraftResult, SpecSession, VerifyResult
from pdflash.spec.speculator import Speculator
from pdflash.stopping import StopRule
from pdflash.target.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
S = SequenceState


@attrs.define(eq=False)
class _Running:
    """What exists only inside `async with`: the lanes, the pacer, the task group."""

    task_group: anyio.abc.TaskGroup
    target: Lane  # prefill, verify (and drafts without a drafter)
    drafter: Lane | None  # drafter forwards and route projection, on their own thread (None: on the target's)
    prefill: BatchLane[Sequence, SpecSession]
    draft: BatchLane[Sequence, DraftResult]  # blocks the drafter drafts (on the drafter lane when there is one)
    plain: BatchLane[Sequence, DraftResult]  # plain-decoding rounds (a block of 1): target work only
    pacer: VerifyPacer
    busy: BusyClock  # wall time with a forward (either lane) or an expert copy running


class AsyncEngine:
    """Serves many concurrent requests over one Speculator. Use as `async with engine:`."""

    def __init__(
        self,
        speculator: Speculator,
        tokenizer: TextTokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        provider: OffloadProvider | None = None,
    ) -> None:
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.config = config if config is not None else EngineConfig()
        self.provider = provider
        self.scheduling = self.config.resolved_scheduling(offloaded=provider is not None)
        if self.scheduling == "derived" and provider is None:
            raise ValueError(
                "scheduling='derived' derives budgets from the offloaded experts' device cache; "
                "without offloading use 'token-only' or the four fixed budgets"
            )
        cache_bytes = provider.budget_bytes if provider is not None else 0
        self.scheduler = self.config.verify_scheduler(
            self.scheduling,
            speculator.block_size,
            speculator.expert_nbytes,
            speculator.target.config.top_k,
            cache_bytes,
        )
        self.planner = SpeculationPlanner(
            self.config.speculation if speculator.drafter is not None else "fixed",
            speculator.block_size,
            provider.link_bytes_per_s if provider is not None else None,
            RoutingShape.of(speculator.expert_nbytes, speculator.target.config.top_k),
        )
        self._work = RoundWork(speculator, self.planner)
        # behind a link, each verify also projects its sequences' next anchors, whose experts the
        # pacer fetches while they draft (a projector that runs the target would cost a pass)
        speculator.project_next_anchors = (
            provider is not None and provider.link_bytes_per_s is not None and speculator.projector.target_free
        )
        # "own" | "shared" (the target's) | None: no drafter; torch's thread count now decides "auto"
        self.drafter_lane = None
        if speculator.drafter is not None:
            own = drafter_has_own_lane(
                self.config.drafter_lane,
                device=speculator.target.device,
                offloaded=provider is not None,
                threads=torch.get_num_threads(),
            )
            self.drafter_lane = "own" if own else "shared"
        # whether a waiting prompt's prefill runs inside the next batched verify (pdflash.engine.prefill_mode)
        self.prefills_ride = prefills_ride_verifies(
            self.config.prefill_mode, offloaded=provider is not None, drafts=speculator.drafter is not None
        )
        self._derived = None
        if self.scheduling == "derived" and provider is not None:
            self._derived = DerivedBudgets(
                token_budget=self.scheduler.budget.tokens,
                expert_bytes_total=sum(speculator.expert_nbytes.values()),
            )
        self._seqs: dict[str, Sequence] = {}  # every sequence not yet released, in arrival order
        self._waiting: deque[Sequence] = deque()
        self._totals = Totals()
        self._ids = itertools.count()
        self._running: _Running | None = None
        self._seats_changed = anyio.Event()  # a request arrived or a sequence left
        self._entered = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the engine's, for aborts from the collector
        self._owned: list[Any] = []  # closed on exit (a provider from_pretrained built)
        self.error: Exception | None = None  # what stopped the pacer or a lane, if a bug did

    @classmethod
    def from_pretrained(
        cls, target: Path | str | None = None, drafter: Path | str | None = None, **options: Any
    ) -> AsyncEngine:
        """Load a target and optionally a DFlash drafter (no target: the bundled pair).

        `options`: the keywords of `pdflash.engine.builder.build_engine_parts` (block_size,
        projector, dtype, device, offload={...} to serve experts from the host store — its
        provider is closed on exit —, progress, compile), and EngineConfig fields.
        """
        build = {name: options.pop(name) for name in BUILD_OPTIONS if name in options}
        engine_config = EngineConfig(**options)
        parts = build_engine_parts(
            target,
            drafter,
            byte_budgets=engine_config.two_dimensional,
            max_batch=engine_config.max_num_seqs,
            drafter_lane=engine_config.drafter_lane,
            **build,
        )
        try:
            engine = cls(parts.speculator, parts.tokenizer, engine_config, provider=parts.provider)
        except BaseException:
            if parts.provider is not None:
                parts.provider.close()
            raise
        if parts.provider is not None:
            engine._owned.append(parts.provider)
        return engine

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        if self._entered:
            raise EngineClosedError("an engine runs once: create a new one instead of re-entering it")
        self._entered = True
        device = self.speculator.target.device
        own_lane = self.drafter_lane == "own"
        target_threads, drafter_threads = lane_threads(torch.get_num_threads(), drafter=own_lane)
        busy = BusyClock()
        target = Lane("target", device, target_threads, busy)
        drafter = Lane("drafter", device, drafter_threads, busy) if drafter_threads else None
        if self.provider is not None:
            self.provider.watch_busy(busy)
        work = self._work
        draft = BatchLane(drafter or target, work.draft_rounds, name="draft", isolation=ROUND_ISOLATION)
        prefill = BatchLane(
            target,
            work.begin_sessions,
            name="prefill",
            cost=lambda s: len(s.prompt_ids),
            max_cost=self.config.prefill_token_budget,
            hold=self._prefill_waits_for_verify,
        )
        running = _Running(
            task_group=anyio.create_task_group(),
            target=target,
            drafter=drafter,
            prefill=prefill,
            draft=draft,
            # on one lane, plain rounds batch with the drafting ones: one call per round, not two
            plain=draft
            if drafter is None
            else BatchLane(target, work.draft_rounds, name="plain", isolation=ROUND_ISOLATION),
            pacer=VerifyPacer(
                self.scheduler,
                self.speculator,
                target,
                self.provider,
                self._derived,
                self._seqs,
                self.planner,
                draft,
                work,
                prefill if self.prefills_ride else None,
            ),
            busy=busy,
        )
        self._running, self._loop = running, asyncio.get_running_loop()
        await running.task_group.__aenter__()
        lanes = (running.prefill, running.draft) + ((running.plain,) if running.plain is not running.draft else ())
        for serve in (*(lane.serve for lane in lanes), running.pacer.serve, self._seater):
            await running.task_group.start(self._guarded, serve)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        running = self._running
        if running is None:
            return None
        for seq in [s for s in self._seqs.values() if s.live]:
            self._abort(seq)
        running.task_group.cancel_scope.cancel()
        # the body's own error propagates as itself, not wrapped in the engine's ExceptionGroup
        body_error = exc_info[1] is not None and not isinstance(exc_info[1], anyio.get_cancelled_exc_class())
        try:
            suppress = await running.task_group.__aexit__(*((None, None, None) if body_error else exc_info))
            return None if body_error else suppress
        finally:
            self._running = None
            with anyio.CancelScope(shield=True):
                for lane in (running.target, running.drafter):
                    if lane is not None:
                        await anyio.to_thread.run_sync(lane.close)  # a running forward finishes first
            for seq in list(self._seqs.values()):
                self._release(seq)
            for owned in self._owned:
                owned.close()

    async def _guarded(self, serve: Callable[..., Any], *, task_status: anyio.abc.TaskStatus) -> None:
        """A lane's or the pacer's loop: a bug there (outside any one sequence) fails every request."""
        try:
            await serve(task_status=task_status)
        except Exception as error:
            self.error = error
            for seq in [s for s in self._seqs.values() if s.live]:
                self._fail(seq, error)
            raise

    # -- the request API ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of output deltas.

        Everything is validated before the request is queued (ValueError; TypeError for a
        wrong type). Breaking out of the iteration, cancelling the consumer or dropping the
        stream (even un-started, once it is garbage collected) aborts it.
        """
        if self.error is not None:
            raise EngineClosedError(f"the engine's step loop stopped: {self.error!r}") from self.error
        if self._running is None:
            raise EngineClosedError("the engine is not running; use it inside `async with engine:`")
        params = request_sampling_params(sampling_params)
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.speculator.target.config.vocab_size)
        cfg = self.speculator.target.config
        StopRule.for_request(len(prompt_ids), params, cfg.max_positions)  # context limit
        text = TextStream(self.tokenizer, params.stop)
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if len(self._waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{len(self._waiting)} requests are already waiting (max_waiting={self.config.max_waiting}); "
                "retry later or raise max_waiting"
            )
        seq = Sequence(request_id, tuple(prompt_ids), params, text)
        self._seqs[request_id] = seq
        self._waiting.append(seq)
        self._totals.requests += 1
        self._seats_changed.set()  # the seater starts its coroutine when a seat is free
        stream = self._stream(seq)
        # an async generator dropped before its first step never runs its `finally`
        weakref.finalize(stream, self._stream_collected, seq)
        return stream

    def _stream_collected(self, seq: Sequence) -> None:
        """Runs inside the garbage collector, maybe mid-step: the abort waits for the loop."""
        if seq.live and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_if_live, seq)

    def _abort_if_live(self, seq: Sequence) -> None:
        if seq.live:
            self._abort(seq)

    async def _stream(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        # No task group or cancel scope around the yield: the mailbox is awaited plainly.
        try:
            while True:
                output = await seq.mailbox.get()
                yield output
                if output.finished:
                    return
        finally:
            if seq.live:  # the consumer left early (break, cancellation, close)
                self._abort(seq)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request and wait until its KV, demand and cache claims are released."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.live:
            return False
        self._abort(seq)
        await seq.released.wait()
        return True

    @property
    def running(self) -> bool:
        """Inside `async with` and neither the pacer nor a lane has died."""
        return self._running is not None and self.error is None

    def stats(self) -> EngineStats:
        return engine_stats(self)

    # -- one sequence ------------------------------------------------------------------------

    async def _serve(self, seq: Sequence) -> None:
        """One sequence, read aloud: prefill; then draft, register the verify, await its admission,
        await the verify, stream; until it finishes. An abort cancels `seq.scope` at any await."""
        running = self._running
        assert running is not None and seq.scope is not None
        try:
            with seq.scope:
                seq.session = await running.prefill.submit(seq)
                await anyio.lowlevel.checkpoint_if_cancelled()
                if self._stream_round(seq, seq.session.emitted, seq.session.finish_reason, seq.prefilled):
                    return
                seq.acceptance = self.planner.track()
                anchor = None  # the next round's anchor, as the verify before projected it
                while True:
                    seq.planned_block = self._work.plan(seq)
                    seq.planned_draft = self._work.draft_tokens(seq)
                    seq.planned_cut = self._work.cut(seq)
                    draft = await self._draft(seq, anchor)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    ticket = self._register(seq, draft)
                    await ticket.wait()
                    result = await running.pacer.verified(seq)
                    anchor = result.next_anchor
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    if self._stream_round(seq, result.accepted_ids, result.finish_reason, seq.verified, result):
                        return
        except AdmissionCancelled:
            pass  # its demand was withdrawn: an abort, already accounted
        except Exception as error:
            if seq.live:
                self._fail(seq, error)
        finally:
            # An abort can land while its admitted verify already runs (it may still be at
            # `ticket.wait()`): its KV is released only once no lane uses it.
            with anyio.CancelScope(shield=True):
                await running.pacer.settled(seq)
            self._release(seq)

    async def _draft(self, seq: Sequence, anchor: Projection | None) -> DraftResult:
        """Its next round, drafted on the drafter lane; or plain (no drafts): its projection is
        target work, on the target lane, so plain rounds batch together as an autoregressive
        engine's do, unless the verify before projected its anchor already (`anchor`), which is
        then the round's projection, no lane asked (pdflash.spec.speculator.Speculator.plain_round)."""
        assert self._running is not None and seq.session is not None
        if seq.planned_draft > 1:
            return await self._running.draft.submit(seq)
        if anchor is None:
            return await self._running.plain.submit(seq)
        return self.speculator.plain_round(seq.session, anchor)

    def _register(self, seq: Sequence, draft: DraftResult) -> Ticket:
        """Its pending verify's exact demand goes to the scheduler; the pacer may tick."""
        expected = (
            self.planner.expected_tokens(seq.acceptance, draft.tokens, draft.confidence, greedy=seq.params.greedy)
            if seq.acceptance
            else 1.0
        )
        ticket = seq.ticket = self.scheduler.register(
            seq.request_id, draft.tokens, draft.expert_union, draft.expert_bytes, draft.fetch_bytes, expected
        )
        seq.expected_tokens = expected
        seq.draft, seq.drafted_at = draft, time.perf_counter()
        seq.verify_done, seq.verify_result, seq.verify_error = anyio.Event(), None, None
        seq.drafted()
        assert self._running is not None
        self._running.pacer.changed()
        return ticket

    def _stream_round(
        self,
        seq: Sequence,
        token_ids: tuple[int, ...] | list[int],
        finish_reason: str | None,
        next_state: Callable[[], bool],
        verified: VerifyResult | None = None,
    ) -> bool:
        """Account and stream a round's tokens; True when the sequence finished with them."""
        if verified is not None:
            trace = verified.trace
            seq.acceptance_lengths.append(trace.acceptance_length)
            seq.block_sizes.append(trace.tokens)
            if seq.acceptance is not None and seq.draft is not None:
                # what the round says of its drafts: the verify's outcome, and for drafts made and not
                # verified (a greedy sequence's shadow drafts), the tokens committed, read against them
                seq.acceptance.round_passed()
                for outcome in seq.shadow.after_round(
                    drafted=seq.draft.drafted,
                    verified=trace.tokens,
                    accepted=verified.accepted_drafts,
                    shadow=seq.draft.shadow,
                    committed=verified.accepted_ids,
                    finished=verified.finished,
                ):
                    seq.acceptance.record(outcome.block, outcome.accepted)
                if trace.tokens >= 2:  # what the drafts realized against what the policy expected of them
                    self.planner.observe_committed(seq.expected_tokens, verified.accepted_drafts + 1)
                    self.planner.observe_drafts(
                        seq.draft.confidence, trace.tokens, verified.accepted_drafts, greedy=seq.params.greedy
                    )
            seq.expert_bytes += trace.expert_bytes
            seq.fetch_bytes += trace.fetch_bytes
            self._totals.verify_rounds += 1
            self._totals.verify_tokens += trace.acceptance_length
            self._release_claim(seq)
        seq.stream(token_ids, finish_reason)
        self._totals.tokens += len(token_ids)
        if finish_reason is None:
            next_state()
            return False
        seq.finish()
        self._totals.finished += 1
        return True

    # -- seats and exits ---------------------------------------------------------------------

    async def _seater(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Hands out seats: wakes when a request arrives or a sequence leaves (tasks start from a task)."""
        task_status.started()
        while True:
            self._seats_changed = anyio.Event()
            self._seat_waiting()
            await self._seats_changed.wait()

    def _seat_waiting(self) -> None:
        """Start the coroutine of each waiting request while seats remain (arrival order), unless a
        seated sequence about to reach its length limit will bring a prompt to prefill with
        (pdflash.engine.seating): its exit changes the seats, and they are offered again."""
        running = self._running
        while running is not None and self._waiting and len(self._seqs) - len(self._waiting) < self.config.max_num_seqs:
            if self._prefill_waits():
                if not self._waiting[0].prefill_held:
                    self._waiting[0].prefill_held = True
                    self._totals.prefills_held += 1
                return
            seq = self._waiting.popleft()
            seq.schedule()
            seq.scope = anyio.CancelScope()
            running.task_group.start_soon(self._serve, seq, name=f"pdflash-seq-{seq.request_id}")

    def _prefill_waits(self) -> bool:
        now = time.perf_counter()
        return prefill_waits(
            link=self.planner.link_bytes_per_s is not None,
            prefill_s=self._work.prefill_s,
            to_limit_s=(
                seconds_to_limit(s.params.max_tokens - s.streamed, s.streamed, now - s.first_token_at)
                for s in self._seqs.values()
                if s.state in (S.DRAFT, S.VERIFY) and s.first_token_at is not None
            ),
        )

    def _prefill_waits_for_verify(self) -> bool:
        in_rounds = sum(s.state in (S.DRAFT, S.VERIFY) for s in self._seqs.values())
        return prefill_waits_for_verify(rides=self.prefills_ride, sequences_in_rounds=in_rounds)

    def _abort(self, seq: Sequence) -> None:
        waiting = seq.state is S.WAITING
        if waiting:
            self._waiting.remove(seq)
        seq.abort()
        seq.close_stream("abort")
        self._totals.aborted += 1
        self._leave(seq)
        if waiting:
            self._release(seq)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("request %s failed in state %s: %r", seq.request_id, seq.state.value, error)
        waiting = seq.state is S.WAITING
        if waiting:
            self._waiting.remove(seq)
        seq.fail()
        seq.mailbox.fail(error)
        self._totals.failed += 1
        self._leave(seq)
        if waiting:
            self._release(seq)

    def _leave(self, seq: Sequence) -> None:
        """An exited sequence drops its demand now; its coroutine releases its KV once no lane uses it."""
        self.scheduler.cancel(seq.request_id)
        if self._running is not None:
            self._running.pacer.changed()
        if seq.scope is not None:
            seq.scope.cancel()

    def _release_claim(self, seq: Sequence) -> None:
        """Its verified round's claim ends (its next anchor's stays until that round's verify ran)."""
        if seq.claim is not None and self.provider is not None:
            self.provider.release(seq.claim)
        seq.claim = None

    def _release(self, seq: Sequence) -> None:
        if seq.released.is_set():
            return
        self.scheduler.cancel(seq.request_id)
        self._release_claim(seq)
        drop_anchor_claim(self.provider, seq)
        if seq.session is not None:
            self.speculator.release(seq.session)
        seq.ticket, seq.draft = None, None
        del self._seqs[seq.request_id]
        seq.released.set()
        self._seats_changed.set()
        if self._running is not None:
            self._running.pacer.changed()  # one fewer sequence a tick may be waiting for
            self._running.prefill.release()  # and one fewer a waiting prefill may be waiting for
