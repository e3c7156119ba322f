"""The simulated pacer: when ticks run, what a launch gathers, the batched verify and what it teaches.

Owns, for pdflash.bench.simulator, what pdflash.engine.pacer.VerifyPacer does in the engine:
a tick when the target lane is about to launch a batch and at most once while a batch runs
(charged against its in-flight union), with a link the wait for sequences still drafting
(`_gather_s`, as VerifyPacer._gather_s), the route-ahead prefetch (one claim per admitted
sequence, pdflash.engine.prefetching's pick, as the engine's), each admitted set as ONE verify
on the target lane (with the prompts waiting to prefill in its forward, when prefills ride
verifies), and after it the scheduler's finish, the planner's observations and each
sequence's next round and each rider's first. Must not model lanes, caches or sequences'
flows: the Simulator does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from pdflash.bench.routing import Round
from pdflash.bench.sim_cache import SimulationError
from pdflash.bench.sim_events import Job
from pdflash.engine.prefetching import launch_certainty, launch_prefetches
from pdflash.spec.projection import ProjectionQuality, union_bytes
from pdflash.spec.session import RoundTrace
from pdflash.spec.speculator import further_token_bytes, position_fetch_bytes
from pdflash.target.experts import ExpertKey

if TYPE_CHECKING:
    from pdflash.bench.simulator import SimRequest, Simulator

STALLED_TICKS = 64  # ticks in a row that admit nothing with nothing running: a configuration that cannot run


def round_of(q: SimRequest) -> Round:
    assert q.pending is not None, f"request {q.rid} has no drafted round"
    return q.pending


class SimPacer:
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._running: list[SimRequest] | None = None  # the batch on the target lane (or queued for it)
        self._running_union: frozenset[ExpertKey] = frozenset()
        self._next: list[SimRequest] = []  # admitted by a tick during the running batch, prefetching
        self._ticked = False
        self._held: list[SimRequest] | None = None  # a serve pass's batch while it gathers
        self._waited = False  # that pass waited for drafting sequences
        self.verify_batches: dict[int, int] = {}  # sequences per batched verify -> batches
        self.ticks_in_flight = 0
        self.prefills_in_verifies = 0  # prompts prefilled inside a verify's forward
        self._ended_at = 0.0  # when the last verify ended (its sequences draft from then)
        self._launch_at: float | None = None  # when this serve pass's bookkeeping is done (it may launch)

    def changed(self) -> None:
        """A demand registered or a sequence left: serve if the target lane has no batch, else
        tick once for the next batch (once no sequence still drafts toward the tick)."""
        if self._running is None:
            self._serve()
        else:
            self._tick_during(self._running)

    def _serve(self) -> None:
        """VerifyPacer.serve, one pass: launch the admitted batch, or tick for one, once gathered."""
        if not self.sim.s.pipelined and any(q.ticket is None for q in self.sim.seated.values()):
            return  # lock-step: a step's tick follows its prefills and every sequence's draft
        if self._held is None:  # a new pass: take what the last tick admitted
            self._held, self._waited = [q for q in self._next if q.pending is not None], False
            self._next = []
        batch = self._held
        if not batch and not (self.sim.scheduler.pending_count() or self.sim.scheduler.admitted_ids()):
            self._held, self._launch_at = None, None  # nothing to launch: the next registration serves again
            return
        if self._launch_at is None:
            # the engine's bookkeeping per launch (the last verify's streaming, the rounds' planning
            # and registering, the lanes' hand-offs) runs on the event loop before the launch and
            # the tick that prefetches for it: the link waits for it as the target lane does
            self._launch_at = self.sim.now + self.sim.s.costs.step_s(len(self.sim.seated))
        if self.sim.now < self._launch_at:
            self.sim.clock.at(self._launch_at, self._serve_if_idle)
            return
        wait_s = self._gather_s(batch)
        if wait_s > 0:  # sequences still drafting would share this batch's experts: wait for them
            self._waited = True
            self.sim.clock.at(self.sim.now + wait_s, self._serve_if_idle)
            return
        self._held = None
        if batch and (self._waited or (self.sim.cache is not None and self.sim.scheduler.pending_count())):
            batch = batch + self._tick(frozenset())  # latecomers join it (VerifyPacer._latecomers_join)
        for _ in range(STALLED_TICKS):
            if batch or not (self.sim.scheduler.pending_count() or self.sim.scheduler.admitted_ids()):
                break
            batch = self._tick(frozenset())  # nothing fits yet: the carried quantum grows each tick
        else:
            raise SimulationError(
                f"{STALLED_TICKS} ticks admitted nothing with nothing running ({self.sim.s.config.name})"
            )
        if batch:
            self._launch(batch)

    def _serve_if_idle(self) -> None:
        if self._running is None:
            self._serve()

    def _gather_s(self, batch: list[SimRequest]) -> float:
        """VerifyPacer._gather_s: how long a launch may still wait for sequences drafting (0: go).

        While other sequences draft toward a demand: with a link, as long as the link is busy
        with `batch`'s copies, or until their drafts are due (a drafter call's measured seconds
        for that many); resident, until their drafts are due if that is sooner than a verify's
        fitted fixed seconds (the launch it saves); never in the lock-step engine."""
        if not self.sim.s.pipelined:
            return 0.0
        coming = sum(1 for q in self.sim.seated.values() if q.acceptance is not None and q.ticket is None)
        if not coming:
            return 0.0
        waiting = batch + [q for q in self.sim.seated.values() if q.ticket is not None and not q.ticket.admitted]
        if not waiting:
            return 0.0
        copying_s = 0.0
        if self.sim.cache is not None:
            prefetching = frozenset().union(*(round_of(q).projected for q in batch))
            resident = self.sim.cache.resident()
            copying_s = union_bytes(prefetching - resident, self.sim.s.byte_map) / self.sim.s.link_bytes_per_s
        drafting_since = max(self._ended_at, *(q.drafted_at for q in waiting))
        drafts_due = drafting_since + self.sim.planner.draft_call_s(coming)
        wait_s = max(0.0, copying_s, drafts_due - self.sim.now)
        if self.sim.cache is None and wait_s >= self.sim.planner.verify_fixed_s:
            return 0.0  # resident: waiting would cost more than the launch it saves
        return wait_s

    def _tick_during(self, batch: list[SimRequest]) -> None:
        """While `batch` runs: one tick for the next batch, as soon as demands wait and it is gathered."""
        if (
            self._running is not batch
            or not self.sim.s.pipelined
            or self._ticked
            or not self.sim.scheduler.pending_count()
        ):
            return
        wait_s = self._gather_s([])
        if wait_s > 0:
            self.sim.clock.at(self.sim.now + wait_s, lambda: self._tick_during(batch))
            return
        self._next, self._ticked = self._tick(self._running_union), True

    def _launch(self, batch: list[SimRequest]) -> None:
        self._running, self._ticked, self._launch_at = batch, False, None
        self.verify_batches[len(batch)] = self.verify_batches.get(len(batch), 0) + 1
        self._running_union = frozenset().union(*(round_of(q).projected for q in batch))
        launched = self.sim.now
        exposed = self.sim.cache.counters.exposed_fetch_s if self.sim.cache is not None else 0.0
        riders = self.sim.prefill.ride() if self.sim.prefills_ride else []  # VerifyPacer._launch's ride
        self.prefills_in_verifies += len(riders)
        self.sim.target.submit(
            lambda: self._verify_job(batch, riders), lambda _: self._verified(batch, riders, launched, exposed)
        )
        self.sim.planner.refit()  # as VerifyPacer._launch: once the verify is on its lane
        self._tick_during(batch)

    def _tick(self, in_flight: frozenset[ExpertKey]) -> list[SimRequest]:
        self.ticks_in_flight += bool(in_flight)
        resident = self.sim.cache.resident() if self.sim.cache is not None else frozenset()
        budget = self.sim.derived.per_tick() if self.sim.derived is not None else None
        self.sim.scheduler.tick(resident, in_flight, budget=budget)
        admitted = [self.sim.seated[cast(int, i)] for i in self.sim.scheduler.admitted_ids()]
        for q in admitted:
            self.sim.scheduler.mark_in_flight(q.rid)
            q.wait_s += self.sim.now - q.drafted_at
        if self.sim.cache is not None:
            projections = [round_of(q).projection for q in admitted]
            missing = frozenset().union(*(p.union for p in projections)) - resident
            certainty = launch_certainty(  # as VerifyPacer._tick
                union_bytes(missing, self.sim.s.byte_map),
                self.sim.s.link_bytes_per_s,
                self.sim.planner.verify_s(sum(round_of(q).tokens for q in admitted), len(admitted)),
            )
            claims = self.sim.cache.prefetch_launch(launch_prefetches(projections, certainty), self.sim.now)
            for q, claim in zip(admitted, claims, strict=True):
                q.claim = claim
        return admitted

    def _claim_next_anchors(self, batch: list[SimRequest], rounds: list[Round]) -> None:
        """As VerifyPacer._claim_next_anchors: each continuing sequence's next anchor, prefetched
        by the launch rule while it drafts, claimed until that round's verify has run."""
        cache = self.sim.cache
        for q in batch:  # the anchors this verify routed were claimed until it ran
            self.sim.drop_anchor_claim(q)
        going = [(q, anchor.projection) for q, r in zip(batch, rounds) if (anchor := self.sim.next_anchor(q, r))]
        if cache is None or not going:
            return
        projections = [p for _, p in going]
        resident = cache.resident()
        missing = frozenset().union(*(p.union for p in projections)) - resident
        certainty = launch_certainty(
            union_bytes(missing, self.sim.s.byte_map),
            self.sim.s.link_bytes_per_s,
            self.sim.planner.verify_s(len(going), len(going)),
        )
        picked = [(q, experts) for (q, _), experts in zip(going, launch_prefetches(projections, certainty)) if experts]
        claims = cache.prefetch_launch([experts for _, experts in picked], self.sim.now)  # their round: one forward
        for (q, experts), claim in zip(picked, claims, strict=True):
            q.anchor_claim, q.anchor_fetch = claim, experts - resident

    def _verify_job(self, batch: list[SimRequest], riders: list[SimRequest]) -> Job:
        rounds = [round_of(q) for q in batch]
        unions = [r.actual for r in rounds] + self.sim.prefill_unions(riders)
        experts = len(frozenset().union(*unions))
        tokens = sum(r.tokens for r in rounds)
        costs, offloaded = self.sim.s.costs, self.sim.offloaded
        if riders:
            prompt_tokens = sum(q.prompt_tokens for q in riders)
            seconds = costs.mixed_s(tokens, len(batch), prompt_tokens, len(riders), experts, offloaded=offloaded)
        else:
            seconds = costs.verify_s(tokens, len(batch), experts, offloaded=offloaded)
        claims = [c for q in batch for c in (q.claim, q.anchor_claim) if c is not None]
        yield from self.sim.forward(unions, *seconds, claims=claims)

    def _verified(self, batch: list[SimRequest], riders: list[SimRequest], launched: float, exposed: float) -> None:
        """As VerifyPacer._verify: finish the demands, teach the planner (a forward that also
        prefilled teaches no verify seconds), then each sequence streams and each rider begins."""
        waited = (self.sim.cache.counters.exposed_fetch_s if self.sim.cache is not None else 0.0) - exposed
        rounds = [round_of(q) for q in batch]
        self._ended_at = self.sim.now
        residents, routes = [q.resident for q in batch], [r.positions for r in rounds]
        known = all(routes)  # per-token routes (fixed-block traces replay whole unions only)
        nbytes = self.sim.s.byte_map
        positions = position_fetch_bytes(residents, routes, nbytes) if known else [()] * len(batch)
        further = further_token_bytes(residents, routes, nbytes) if known else [0] * len(batch)
        traces = [self._trace(r, p, f) for r, p, f in zip(rounds, positions, further, strict=True)]
        self._claim_next_anchors(batch, rounds)
        alike = len({r.tokens >= 2 for r in rounds}) == 1
        for q, r in zip(batch, rounds, strict=True):
            self.sim.scheduler.finish(q.rid)
            if alike and q.verified_at:  # as VerifyPacer._verify: its round since its last verify ended
                self.sim.planner.observe_round(r.tokens, r.acceptance_length, self.sim.now - q.verified_at)
            q.verified_at = self.sim.now
        self.sim.planner.observe_verify(
            traces,
            None if riders else max(0.0, self.sim.now - launched - waited),
            len(frozenset().union(*(r.actual for r in rounds))),
        )
        self._running = None
        for q, r in zip(batch, rounds, strict=True):
            self.sim.stream(q, r)
        if riders:
            self.sim.prefilled(riders)
        # the pacer launches its next batch after the sequences' follow-up rounds were submitted
        # (measured on the engine: a plain round of batch N reaches the target lane before N+1's verify)
        self.sim.clock.at(self.sim.now, self._serve_if_idle)

    def _trace(self, r: Round, positions: tuple[int, ...], further: int) -> RoundTrace:
        nbytes = self.sim.s.byte_map
        return RoundTrace(
            start=0,
            tokens=r.tokens,
            acceptance_length=r.acceptance_length,
            expert_bytes=union_bytes(r.projected, nbytes),
            fetch_bytes=0,
            actual_bytes=union_bytes(r.actual, nbytes),
            quality=ProjectionQuality.compare(r.projected, r.actual, nbytes),
            position_fetch_bytes=positions,
            further_token_bytes=further,
        )
