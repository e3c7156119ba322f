"""The verify pacer: one admission tick per verify launch, each batch's fetches hidden behind its predecessor.

Owns when ticks run (when the target lane is about to launch a batch and, at most once while
a batch runs, as soon as new demands wait; once the sequences still drafting have joined, or
waiting longer would idle the link, or, resident, cost more than the launch it saves:
`_gather_s`), the budgets of each tick (fixed, token-only, or derived: every seat's block),
the route-ahead prefetch of every admitted verify (one cache claim per sequence, what
pdflash.engine.prefetching picks for the tick's admitted set), launching each admitted set as
ONE batched verify (with the prompts waiting to prefill in the same forward, when prefills ride
verifies: pdflash.engine.prefill_mode), and handing each sequence its result. Must not touch
lifecycles: every sequence's own coroutine registers its demand, awaits its ticket and then
`verified(seq)`.

    lane:   [ verify N           ][ verify N+1          ][ ...
    tick:   ^ N+1 charged against resident + N's union (in flight)
    copies: [ N+1's marginal union ][ N+2's ...
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Set
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from pdflash.engine.admission import TokensBytes
from pdflash.engine.builder import OffloadProvider
from pdflash.engine.charging import UnionOf
from pdflash.engine.lanes import BatchLane, Lane, Ride
from pdflash.engine.prefetching import launch_certainty, launch_prefetches
from pdflash.engine.round_work import RoundWork
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.engine.sequence import Sequence, SequenceState
from pdflash.engine.speculation import SpeculationPlanner
from pdflash.spec.projection import Projection
from pdflash.spec.session import SpecSession, VerifyResult
from pdflash.spec.speculator import Speculator
from pdflash.target.experts import ExpertKey

log = logging.getLogger(__name__)
T = TypeVar("T")
TICK_TIMES = 4096  # tick start times remembered (tests and stats)


@attrs.frozen(kw_only=True)
class DerivedBudgets:
    """A tick's budgets with offloading: every block of every seat, whatever its experts' bytes.

    Bytes shape a round through the policy's block lengths, the order a tick offers waiting
    verifies in (pdflash.engine.ordering) and how long a launch waits for sequences still
    drafting, not through a per-tick byte bound: each bound measured (a link quantum, the
    cache less what the running batch holds, the whole cache) split the sequences that share
    experts into cohorts that each fetched the shared ones again (issue 19, docs/engine.md).
    The running batch's experts are protected by their claims, not by the budget.
    """

    token_budget: int  # tokens per tick (every block of every seat)
    expert_bytes_total: int  # every expert's bytes: no tick's marginal union can exceed it

    def per_tick(self) -> TokensBytes:
        return TokensBytes(self.token_budget, max(1, self.expert_bytes_total))


@attrs.define
class PacerStats:
    launches: int = 0  # batched verifies launched
    ticks: int = 0
    ticks_in_flight: int = 0  # ticks charged against a non-empty in-flight union
    prefetch_requests: int = 0  # route-ahead prefetches issued (one per admitted verify)
    anchor_prefetches: int = 0  # of them, a verified sequence's next anchor, fetched while it drafts
    prefetch_errors: int = 0
    prefills_in_verifies: int = 0  # prompts prefilled inside a batched verify's forward
    tick_times: deque[float] = attrs.Factory(lambda: deque(maxlen=TICK_TIMES))  # perf_counter s


class VerifyPacer:
    def __init__(
        self,
        scheduler: VerifyScheduler,
        speculator: Speculator,
        lane: Lane,
        provider: OffloadProvider | None,
        derived: DerivedBudgets | None,
        seqs: Mapping[Any, Sequence],  # by request id
        planner: SpeculationPlanner,
        drafts: BatchLane,  # where drafted blocks run (its busy seconds: the time drafting took)
        work: RoundWork,
        prefills: BatchLane[Sequence, SpecSession] | None = None,  # whose waiting batches ride verifies
    ) -> None:
        self.scheduler, self.speculator, self.lane, self.drafts = scheduler, speculator, lane, drafts
        self.work, self.prefills = work, prefills
        self._seqs = seqs  # the engine's live sequences, by request id
        self.provider, self.derived, self.planner = provider, derived, planner
        self.stats = PacerStats()
        self.verify_batches: dict[int, int] = {}  # sequences per batched verify -> batches
        self._changed = anyio.Event()  # a demand registered, or a batch ended
        self._running: list[Sequence] = []  # the batch on the lane now
        self._next: list[Sequence] = []  # admitted by a tick, prefetching, not yet launched
        self._ended_at = 0.0  # perf_counter s when the last verify ended (its sequences draft from then)
        self._drafted_at_end = 0.0  # seconds spent drafting when it ended
        self._last_ids: set[Any] = set()  # request ids of the last launch

    def changed(self) -> None:
        """A sequence registered (or withdrew) a demand: the pacer may tick."""
        self._changed.set()

    async def verified(self, seq: Sequence) -> VerifyResult:
        """After its ticket is admitted: wait for the batched verify that includes `seq`."""
        await seq.verify_done.wait()
        if seq.verify_error is not None:
            raise seq.verify_error
        assert seq.verify_result is not None  # set with verify_done
        return seq.verify_result

    async def settled(self, seq: Sequence) -> None:
        """Return once no verify on the lane uses `seq`'s session (at once if none does): the
        caller may then release it, whichever await its abort interrupted."""
        if seq in self._running:
            await seq.verify_done.wait()

    # -- the loop ------------------------------------------------------------------------------

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            batch = [s for s in self._next if s.state is SequenceState.VERIFY]  # aborted ones left
            self._next = []
            if not batch:
                await self._until_demands()
                await self._until_gathered(batch)
                batch = self._tick(in_flight_union=frozenset())
                if not batch:  # nothing fits yet: the carried quantum grows each tick (bounded by the cap)
                    await anyio.lowlevel.checkpoint()
                    continue
            elif self._gather_s(batch) > 0 or self._latecomers_join():  # admitted while the last verify ran
                await self._until_gathered(batch)
                batch += self._tick(in_flight_union=frozenset())  # latecomers join it
            await self._launch(batch)

    async def _until_demands(self) -> None:
        while not self.scheduler.pending_count() and not self.scheduler.admitted_ids():
            self._changed = anyio.Event()
            await self._changed.wait()

    async def _until_gathered(self, batch: list[Sequence]) -> None:
        while (wait_s := self._gather_s(batch)) > 0:
            self._changed = anyio.Event()
            with anyio.move_on_after(wait_s):
                await self._changed.wait()

    def _latecomers_join(self) -> bool:
        """Behind a link, demands registered since the tick that admitted the next batch join its
        launch: merged, their experts cross the link once (a plain round registers the moment its
        verify ends, so without this it went alone after the batch it just missed: 33-47 launches
        of one or two sequences instead of 7-11 at c = 4). Resident, `_gather_s`'s rule stands: they
        make the next cohort, which drafts while this one verifies."""
        linked = self.provider is not None and self.provider.link_bytes_per_s is not None
        return linked and self.scheduler.pending_count() > 0

    def _gather_s(self, batch: list[Sequence]) -> float:
        """Seconds the next launch may still wait for sequences drafting toward a demand (0: go).

        With a link, launching the verifies that registered first alone fetches their union now
        and the latecomers' a round later, though the two would share experts (in a large batch,
        most of them): sequences split into cohorts that each pay for the whole cache. So the
        launch of `batch` (admitted, prefetching) and of the waiting demands waits while other
        sequences still draft, as long as the link is busy with `batch`'s copies anyway, or for
        as long as the drafts take (a drafter call's measured seconds for that many): merged,
        a round's experts cross the link once. Without a link (resident experts) what merging
        saves is a launch: a second, smaller verify pays the verify's fixed seconds again (on
        a CPU, or a GPU at small batches, most of its cost). So it waits only while the drafts
        are due sooner than that; slower drafts overlap the verify as two cohorts. Unless the
        drafts run on the verify lane itself (a shared drafter lane): a verify launched now
        would run after them anyway, so waiting for them costs the lane nothing, and while
        drafts are queued or running there the launch waits for them however long they take
        (each ends in a registration or an exit, and either wakes the pacer).

        A sequence whose last round was plain is expected to plan a plain round again: no
        drafter call, its demand due after the loop's hand-offs alone (the planner's measured
        seconds between rounds). Counted as a draft, a resident batch launched without the
        plain rounds that had just ended, and two cohorts of plain rounds took turns on the
        lane for good once drafting had split them (c = 16: 692 launches of 8 where plain
        decoding made 383 of 15).
        """
        link = self.provider.link_bytes_per_s if self.provider is not None else None
        coming = [s for s in self._seqs.values() if _drafting(s)]
        if not coming:
            return 0.0
        drafts = sum(s.planned_block >= 2 for s in coming)
        busy = {id(s) for s in self._running} | {id(s) for s in self._next}
        waiting = batch + [s for s in self._seqs.values() if _awaiting_admission(s) and id(s) not in busy]
        if not waiting:
            return 0.0
        copying_s = 0.0
        if link is not None and self.provider is not None:
            prefetching = frozenset().union(*(s.draft.expert_union for s in batch if s.draft is not None))
            copying_s = self.speculator.union_bytes(prefetching - self.provider.resident()) / link
        drafting_since = max(self._ended_at, *(s.drafted_at for s in waiting))
        drafts_due = drafting_since + (self.planner.draft_call_s(drafts) if drafts else self.planner.idle_s)
        wait_s = max(0.0, copying_s, drafts_due - time.perf_counter())
        if self.drafts.lane is self.lane:
            return math.inf if self.drafts.working else wait_s  # drafts ahead of any verify on this lane
        if link is None and wait_s >= self.planner.verify_fixed_s:
            return 0.0  # resident, drafts beside verifies: waiting would cost more than the launch it saves
        return wait_s

    async def _launch(self, batch: list[Sequence]) -> None:
        """Run `batch` as one verify; meanwhile admit (and prefetch) the next once demands wait."""
        self._running = batch
        self._observe_gap(batch)
        self._last_ids = {s.request_id for s in batch}
        self.stats.launches += 1
        self.verify_batches[len(batch)] = self.verify_batches.get(len(batch), 0) + 1
        union = UnionOf(s.draft.expert_union for s in batch if s.draft is not None)  # the scheduler knows their masks
        ride = self.prefills.ride() if self.prefills is not None else None
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._verify, batch, ride, done)
            tg.start_soon(self._refit)  # its first step runs once the verify waits on its lane
            ticked = False
            while not done.is_set():
                wait_s = self._gather_s([]) if not ticked and self.scheduler.pending_count() else None
                if wait_s == 0:
                    self._next = self._tick(in_flight_union=union)
                    ticked = True
                    continue
                self._changed = anyio.Event()
                with anyio.move_on_after(wait_s if wait_s is not None else float("inf")):
                    await self._changed.wait()
        self._running = []

    def _observe_gap(self, batch: list[Sequence]) -> None:
        """The seconds between rounds, as `batch` launches (SpeculationPlanner.observe_idle): the
        lane's gap since the last verify ended, drafting aside, if the batch holds sequences of
        that verify; else, if it holds plain rounds, the longest of their own hand-offs from their
        last verify's end to their demand. Measured only from the lane's gaps, the estimate stayed
        0 once plain rounds took turns in cohorts (a launch never held the last one's sequences),
        and `_gather_s` never waited for a cohort again: 1,127 launches of 11, 4 and 1 at c = 16
        resident where plain decoding made 383 of 16, with prompts prefilled one by one."""
        if any(s.request_id in self._last_ids for s in batch):
            self.planner.observe_idle(time.perf_counter() - self._ended_at - (self._drafted_s() - self._drafted_at_end))
        elif handoffs := [s.drafted_at - s.verified_at for s in batch if s.planned_draft == 1 and s.verified_at]:
            self.planner.observe_idle(max(handoffs))

    async def _refit(self) -> None:
        """The planner's verify fit, solved while a verify runs (SpeculationPlanner.refit)."""
        self.planner.refit()

    async def _verify(self, batch: list[Sequence], ride: Ride[Sequence, SpecSession] | None, done: anyio.Event) -> None:
        started, waited = time.perf_counter(), self._exposed_fetch_s()
        outcomes: list[VerifyResult | BaseException]
        try:
            with anyio.CancelScope(shield=True):  # the thread runs to the end whatever happens here
                outcomes = await self._verify_rounds(batch, ride)
        except Exception as error:  # a bug around the rounds themselves: this batch's sequences fail, no other
            log.exception("a batched verify of %d sequences failed outside its rounds", len(batch))
            outcomes = [error] * len(batch)
            if ride is not None:
                ride.fail(error)
        finally:
            self._ended_at = time.perf_counter()
            self._drafted_at_end = self._drafted_s()
            elapsed = self._ended_at - started
            done.set()
            self._changed.set()
        self._claim_next_anchors(batch, outcomes)
        # a batch of one kind, blocks or plain rounds, times its sequences' rounds (a block riding a plain batch
        # is nearly free, and not what blocks cost once every sequence drafts: SpeculationPlanner.drafting_loses)
        alike = len({o.trace.tokens >= 2 for o in outcomes if isinstance(o, VerifyResult)}) == 1
        for seq, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                seq.verify_error = outcome
            else:
                seq.verify_result = outcome
                if alike and seq.verified_at:
                    trace = outcome.trace
                    self.planner.observe_round(trace.tokens, trace.acceptance_length, self._ended_at - seq.verified_at)
            seq.verified_at = self._ended_at
            seq.verify_done.set()  # every sequence of the batch hears back, whatever happened
            if seq.live:  # an aborted one already withdrew its demand
                self.scheduler.finish(seq.request_id)
        verified = [o for o in outcomes if isinstance(o, VerifyResult)]
        if verified:  # what the policy learns: compute seconds (link waits excluded), experts, bytes per position
            compute_s = max(0.0, elapsed - (self._exposed_fetch_s() - waited)) if ride is None else None
            experts = len(frozenset[ExpertKey]().union(*(o.routed_union for o in verified)))
            self.planner.observe_verify([o.trace for o in verified], compute_s, experts)

    async def _verify_rounds(
        self, batch: list[Sequence], ride: Ride[Sequence, SpecSession] | None
    ) -> list[VerifyResult | BaseException]:
        """One batched verify, with `ride`'s prompts prefilled in its forward; if it raises, each
        prompt and each sequence alone (rewound first), so only culprits fail."""
        sessions = [s.session for s in batch]
        riders = ride.items if ride is not None else []
        together = len(batch) + len(riders) > 1
        snapshots = [session.snapshot() for session in sessions if session is not None] if together else []
        try:
            if ride is None:
                return list(await self.lane.run(self._passing(batch, self.speculator.verify_rounds), sessions))
            verified, begun = await self.lane.run(self._passing(batch, self.work.verify_and_begin), sessions, riders)
            self.stats.prefills_in_verifies += len(riders)
            ride.finish(begun)
            return list(verified)
        except Exception as error:
            if not together:
                return [error]
            log.warning(
                "a batched verify of %d sequences and %d prompts raised %r; retrying them one by one",
                len(batch),
                len(riders),
                error,
            )
        if ride is not None:
            begun_alone: list[SpecSession | BaseException] = []
            for seq in riders:
                try:
                    begun_alone.append((await self.lane.run(self.work.begin_sessions, [seq]))[0])
                except Exception as error:
                    begun_alone.append(error)
            ride.finish(begun_alone)
        outcomes: list[VerifyResult | BaseException] = []
        for session, snapshot in zip(sessions, snapshots, strict=True):
            assert session is not None
            session.restore(snapshot)
            try:
                outcomes.append((await self.lane.run(self.speculator.verify_rounds, [session]))[0])
            except Exception as error:
                outcomes.append(error)
        return outcomes

    def _passing(self, batch: list[Sequence], forward: Callable[..., T]) -> Callable[..., T]:
        """`forward` run as the verify of `batch`'s claims: the cache ends each layer's claims as
        the forward leaves it, so the fetches for what comes next may use those slots."""
        claims = [c for s in batch for c in (s.claim, s.anchor_claim) if c is not None]
        if self.provider is None or not claims:
            return forward
        provider = self.provider

        def passing(*args: Any) -> T:
            with provider.forward_of(claims):
                return forward(*args)

        return passing

    def _drafted_s(self) -> float:
        return self.drafts.busy_s

    def _exposed_fetch_s(self) -> float:
        """Seconds forwards have waited on expert copies so far (0 without offloading)."""
        return self.provider.exposed_fetch_s if self.provider is not None else 0.0

    # -- a tick ----------------------------------------------------------------------------------

    def _tick(self, in_flight_union: Set[ExpertKey]) -> list[Sequence]:
        """One admission tick: the admitted sequences, their demands seated and their unions prefetched."""
        self.stats.ticks += 1
        self.stats.ticks_in_flight += bool(in_flight_union)
        self.stats.tick_times.append(time.perf_counter())
        resident = self.provider.resident() if self.provider is not None else frozenset()  # carries its bitmask
        budget = self.derived.per_tick() if self.derived is not None else None
        self.scheduler.tick(resident, in_flight_union, budget=budget)
        # what this tick admitted, and any a cancel's refund re-assigned since the last one
        admitted = [self._seqs[i] for i in self.scheduler.admitted_ids() if i in self._seqs]
        now = time.perf_counter()
        for seq in admitted:
            self.scheduler.mark_in_flight(seq.request_id)
            seq.admission_wait_s += now - seq.drafted_at
        if self.provider is not None:
            drafted = [(s, d) for s in admitted if (d := s.draft) is not None]
            projections = [Projection(d.expert_union, d.expert_probability) for _, d in drafted]
            # what their next-anchor prefetches brought in is this launch's copies, begun early
            early = frozenset().union(*(s.session.anchor_fetch for s, _ in drafted if s.session is not None))
            missing = frozenset().union(*(p.union for p in projections)) - (resident - early)
            certainty = launch_certainty(
                self.speculator.union_bytes(missing),
                self.provider.link_bytes_per_s,
                self.planner.verify_s(sum(d.tokens for _, d in drafted), len(drafted)),
            )
            claims = self._prefetch(launch_prefetches(projections, certainty))
            for (seq, _), claim in zip(drafted, claims, strict=True):
                seq.claim = claim
        return admitted

    def _claim_next_anchors(self, batch: list[Sequence], outcomes: list[VerifyResult | BaseException]) -> None:
        """Prefetch, for each sequence the verify leaves going on, what its next anchor (its next
        round's first token, whatever its block) will route, by the launch rule: behind a link
        nothing is known to fetch while sequences draft toward their next demands, and every
        round routes its anchor. Only for sequences whose round drafted: one that decodes plainly
        has no draft to hide the copies behind (its next round is projected and admitted at
        once, the same anchor, priced by its own launch; at c = 4, anchors fetched for plain
        rounds cost adaptive speculation 5% more bytes). The claim holds until that round's
        verify has run (its forward passes it layer by layer, as its round's own claim), so what
        it fetched is not evicted in between when the round's prefetch picks fewer experts."""
        if self.provider is None:
            return
        for seq in batch:  # the anchors this verify routed were claimed until it ran
            drop_anchor_claim(self.provider, seq)
        going = [
            (seq, outcome.next_anchor)
            for seq, outcome in zip(batch, outcomes, strict=True)
            if isinstance(outcome, VerifyResult)
            and outcome.next_anchor is not None
            and seq.live
            and seq.planned_draft > 1
        ]
        if not going:
            return
        projections = [projection for _, projection in going]
        resident = self.provider.resident()
        missing = frozenset().union(*(p.union for p in projections)) - resident
        certainty = launch_certainty(
            self.speculator.union_bytes(missing),
            self.provider.link_bytes_per_s,
            self.planner.verify_s(len(going), len(going)),
        )
        picked = [
            (seq, experts) for (seq, _), experts in zip(going, launch_prefetches(projections, certainty)) if experts
        ]
        claims = self._prefetch([experts for _, experts in picked]) if picked else []  # their round: one forward too
        self.stats.anchor_prefetches += sum(claim is not None for claim in claims)
        for (seq, experts), claim in zip(picked, claims, strict=True):
            seq.anchor_claim = claim
            if seq.session is not None and claim is not None:  # what its next round's positions are measured against
                seq.session.anchor_fetch = experts - resident

    def _prefetch(self, unions: list[frozenset[ExpertKey]]) -> list[Any]:
        """Route-ahead, one claim per verify of one forward: the provider queues the copies on its
        own thread and claims them; never blocks. None for each when it fails."""
        assert self.provider is not None
        self.stats.prefetch_requests += len(unions)
        try:
            return self.provider.prefetch_launch(unions)
        except Exception as error:  # a failed prefetch only means on-demand fetches later
            self.stats.prefetch_errors += 1
            log.warning("route-ahead prefetch failed: %r", error)
            return [None] * len(unions)


def drop_anchor_claim(provider: OffloadProvider | None, seq: Sequence) -> None:
    """End `seq`'s claim on its next anchor's experts (the verify of its round ran, or it left)."""
    if seq.anchor_claim is not None and provider is not None:
        provider.release(seq.anchor_claim)
    seq.anchor_claim = None
    if seq.session is not None:
        seq.session.anchor_fetch = frozenset()


def _drafting(seq: Sequence) -> bool:
    """On its way to a demand: drafting, or verified and about to draft again."""
    return seq.state is SequenceState.DRAFT or (seq.state is SequenceState.VERIFY and seq.verify_done.is_set())


def _awaiting_admission(seq: Sequence) -> bool:
    return seq.state is SequenceState.VERIFY and not seq.verify_done.is_set() and seq.draft is not None
