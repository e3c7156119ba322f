"""`pdflash simulate`: the pipelined engine as a discrete-event run on a virtual clock.

Owns the simulated engine: one flow per sequence (prefill, then plan -> draft -> register ->
admission -> verify -> stream, as AsyncEngine._serve), the lanes it runs on (target: prefill,
plain-decoding rounds, verifies; drafter: drafted blocks; the cache's copy engine: every
expert copy) and the pacer (one tick when the target lane is about to launch a batch and at
most once while a batch runs, as pdflash.engine.pacer.VerifyPacer), so batch N+1's copies
run during batch N's compute and wall time is what that schedule gives. The engine's own
pieces decide: the REAL VerifyScheduler built by EngineConfig.verify_scheduler, the derived
budgets (DerivedBudgets), the offer order, the SpeculationPlanner with the speculation policy
and acceptance estimates, and the eviction policies (in SimCache). Only forwards (a CostModel),
the link (bytes / rate) and routing (a RoutingSource) are modelled. Clients and per-request
records are pdflash.bench.sim_clients'. Must not touch engines or tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import attrs

from pdflash.bench.configs import BenchConfig
from pdflash.bench.costs import CostModel
from pdflash.bench.metrics import RequestRecord, Traffic
from pdflash.bench.routing import Round, RoutingSource
from pdflash.bench.sim_cache import SimCache, SimulationError
from pdflash.bench.sim_events import Clock, Job, SimBatchLane, SimLane
from pdflash.engine.config import EngineConfig
from pdflash.engine.pacer import DerivedBudgets
from pdflash.engine.speculation import SpeculationPlanner
from pdflash.engine.ticket import Ticket
from pdflash.spec.acceptance import SequenceAcceptance
from pdflash.spec.policy import expected_committed
from pdflash.spec.projection import ProjectionQuality, union_bytes
from pdflash.spec.session import RoundTrace
from pdflash.spec.speculator import position_fetch_bytes
from pdflash.target.experts import ExpertKey

STALLED_TICKS = 64  # ticks in a row that admit nothing with nothing running: a configuration that cannot run


@attrs.frozen(kw_only=True)
class SimSetup:
    """Everything one simulated point needs besides its clients."""

    config: BenchConfig
    costs: CostModel
    routing: RoutingSource
    byte_map: Mapping[ExpertKey, int]  # bytes per (layer, expert), as stored
    moe_layers: tuple[int, ...]
    top_k: int  # experts each token routes per MoE layer (the byte cap's liveness bound)
    block_size: int  # the drafter's block (1 is used for autoregressive configurations)
    cache_slots: int  # experts the device cache holds (offloaded configurations)
    cache_bytes: int  # the device cache's byte budget, as the engine reads it (derived budgets)
    link_bytes_per_s: float  # the copy engine's rate
    policy: str = "activation"
    max_num_seqs: int = 64
    prefill_token_budget: int = 4096
    budgets: dict | None = None  # the four verify_* budgets of a fixed 2-D configuration
    # False: the engine before the pipelined one (main up to 73fabf9), which measured the first
    # validation table: a lock-step loop (drafts on the verify thread, no tick while a verify runs)
    # and a cache whose claims ended when a forward reached their layer
    pipelined: bool = True


@attrs.define(eq=False)
class SimRequest:
    rid: int  # request number, the scheduler's seq id
    route: int  # routing sequence (prompt index)
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    client: int | None
    acceptance: SequenceAcceptance | None = None
    emitted: int = 0
    rounds: int = 0
    unseen: int = 0  # target features the drafter has not drafted on yet
    planned: int = 1  # the block the planner chose for the round being drafted
    pending: Round | None = None  # the drafted round awaiting its verify
    resident: frozenset[ExpertKey] = frozenset()  # resident when it was drafted
    ticket: Ticket | None = None
    claim: tuple[ExpertKey, ...] | None = None  # its route-ahead prefetch's claim
    drafted_at: float = 0.0
    times: list[float] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    lengths: list[int] = attrs.Factory(list)
    wait_s: float = 0.0
    coverage: list[float] = attrs.Factory(list)


def _round(q: SimRequest) -> Round:
    assert q.pending is not None, f"request {q.rid} has no drafted round"
    return q.pending


def _scheduler_config(cfg: BenchConfig, max_num_seqs: int, budgets: dict | None) -> EngineConfig:
    if cfg.derived:
        return EngineConfig(max_num_seqs=max_num_seqs, scheduling="derived", verify_order=cfg.verify_order)
    if cfg.two_dimensional:
        if not budgets:
            raise SimulationError(f"{cfg.name} is a fixed 2-D configuration: give it the four verify_* budgets")
        return EngineConfig(max_num_seqs=max_num_seqs, scheduling="fixed", verify_order=cfg.verify_order, **budgets)
    return EngineConfig(max_num_seqs=max_num_seqs, scheduling="token-only")


class Simulator:
    """One point: its sequences, the lanes, the pacer, the real scheduler and the simulated cache."""

    def __init__(self, setup: SimSetup, max_tokens: int) -> None:
        self.s, cfg = setup, setup.config
        self.max_tokens = max_tokens  # per request, unless its replayed trace ended sooner
        self.clock = Clock()
        self.block = setup.block_size if cfg.speculative else 1
        self.cache = (
            SimCache(
                setup.byte_map,
                slots=setup.cache_slots,
                link_bytes_per_s=setup.link_bytes_per_s,
                policy=setup.policy,
                claims_per_layer=not setup.pipelined,
            )
            if cfg.offloaded
            else None
        )
        engine_config = _scheduler_config(cfg, setup.max_num_seqs, setup.budgets)
        mode = engine_config.resolved_scheduling(offloaded=cfg.offloaded)
        self.scheduler = engine_config.verify_scheduler(
            mode, self.block, setup.byte_map, setup.top_k, setup.cache_bytes if cfg.offloaded else 0
        )
        self.derived = (
            DerivedBudgets(token_budget=self.scheduler.budget.tokens, expert_bytes_total=sum(setup.byte_map.values()))
            if mode == "derived"
            else None
        )
        self.planner = SpeculationPlanner(
            cfg.speculation if cfg.speculative else "fixed",
            self.block,
            setup.link_bytes_per_s if cfg.offloaded else None,
        )
        self.router = cfg.offloaded or cfg.two_dimensional  # the engine's default projector choice
        self.target = SimLane(self.clock, "target")
        self.drafter = SimLane(self.clock, "drafter") if setup.pipelined else self.target
        self.prefill = SimBatchLane(
            self.target,
            self._prefill_job,
            self._prefilled,
            cost=lambda q: q.prompt_tokens,
            max_cost=setup.prefill_token_budget,
        )
        self.draft = SimBatchLane(self.drafter, self._draft_job, self._drafted)
        self.plain = SimBatchLane(self.target, self._plain_job, self._drafted)
        self.waiting: list[SimRequest] = []
        self.seated: dict[int, SimRequest] = {}  # by request id: prefilling or in rounds
        self.done: list[SimRequest] = []
        self.on_finish = lambda q: None  # the clients' hook: a finished request may send the next
        self._running: list[SimRequest] | None = None  # the batch on the target lane (or queued for it)
        self._running_union: frozenset[ExpertKey] = frozenset()
        self._next: list[SimRequest] = []  # admitted by a tick during the running batch, prefetching
        self._ticked = False
        self._held: list[SimRequest] | None = None  # a serve pass's batch while it gathers
        self._waited = False  # that pass waited for drafting sequences
        self.verify_batches: dict[int, int] = {}  # sequences per batched verify -> batches
        self.ticks_in_flight = 0

    @property
    def now(self) -> float:
        return self.clock.now

    # -- arrivals and seats --
    def arrive(self, q: SimRequest) -> None:
        self.waiting.append(q)
        self._seat()

    def _seat(self) -> None:
        while self.waiting and len(self.seated) < self.s.max_num_seqs:
            q = self.waiting.pop(0)
            self.seated[q.rid] = q
            self.prefill.submit(q)

    def _exit(self, q: SimRequest) -> None:
        self.done.append(q)
        del self.seated[q.rid]
        self.on_finish(q)
        self._seat()
        self._changed()  # one fewer sequence a gathering launch may wait for

    # -- forwards (lane jobs) --
    def _forward(self, unions: Sequence[frozenset[ExpertKey]], dense_s: float, expert_s: float) -> Job:
        """A target forward layer by layer: attention and routing, then the MoE block, which asks
        for its missing experts and computes in waves as they land (the last wave after the last
        copy), as OffloadedExperts.waves serves a forward."""
        if self.cache is None:
            yield self.now + dense_s + expert_s
            return
        dense_l, expert_l = dense_s / len(self.s.moe_layers), expert_s / len(self.s.moe_layers)
        by_layer: dict[int, set[int]] = {layer: set() for layer in self.s.moe_layers}
        for union in unions:
            for layer, expert in union:
                by_layer[layer].add(expert)
        for layer in self.s.moe_layers:
            yield self.now + dense_l
            experts = by_layer[layer]
            held, ready = self.cache.acquire(layer, experts, self.now)
            done = max(self.now + expert_l, ready + expert_l / max(1, len(experts)))
            self.cache.counters.exposed_fetch_s += done - self.now - expert_l
            yield done
            self.cache.unpin(held)

    def _prefill_job(self, batch: list[SimRequest]) -> Job:
        tokens = sum(q.prompt_tokens for q in batch)
        unions = [self.s.routing.prefill_union(q.route, q.prompt_tokens) for q in batch]
        experts = len(frozenset().union(*unions))
        yield from self._forward(unions, *self.s.costs.prefill_s(tokens, len(batch), experts, offloaded=self._offl))

    def _draft_job(self, batch: list[SimRequest]) -> Job:
        """The drafter lane: drafter forward and route projection of blocks of 2 or more."""
        sizes = [min(q.planned, q.max_tokens - q.emitted + 1) for q in batch]
        drafting = [q for q, size in zip(batch, sizes, strict=True) if size >= 2]
        context = sum(q.unseen for q in drafting)
        seconds = self.s.costs.draft_s(len(batch), sum(sizes), context, speculative=bool(drafting), router=self.router)
        yield self.now + seconds
        self.planner.observe_draft(len(drafting), seconds)
        return sizes

    def _plain_job(self, batch: list[SimRequest]) -> Job:
        """The target lane: plain-decoding rounds (a block of 1: the route projection only)."""
        yield self.now + self.s.costs.draft_s(len(batch), len(batch), 0, speculative=False, router=self.router)
        return [1] * len(batch)

    @property
    def _offl(self) -> bool:
        return self.cache is not None

    # -- one sequence's flow --
    def _prefilled(self, batch: list[SimRequest], _: object) -> None:
        for q in batch:
            q.unseen = q.prompt_tokens
            self._emit(q, 1)
            if q.emitted >= q.max_tokens:
                self._exit(q)
                continue
            q.acceptance = self.planner.track()
            self._plan(q)

    def _plan(self, q: SimRequest) -> None:
        """Ask the planner for the next block (RoundWork.plan: greedy requests follow the policy)."""
        assert q.acceptance is not None
        choice = self.planner.plan(q.acceptance)
        q.planned = choice.block if choice is not None else self.block
        (self.draft if q.planned > 1 else self.plain).submit(q)

    def _drafted(self, batch: list[SimRequest], sizes: list[int]) -> None:
        resident = self.cache.resident() if self.cache is not None else frozenset()
        for q, size in zip(batch, sizes, strict=True):
            if size >= 2:
                q.unseen = 0
            r = q.pending = self.s.routing.round(q.route, q.rounds, size, q.emitted - 1)
            q.resident = resident
            expected = expected_committed(q.acceptance.estimate(), size) if q.acceptance is not None else 1.0
            full = union_bytes(r.projected, self.s.byte_map)
            fetch = union_bytes(r.projected - resident, self.s.byte_map)
            q.ticket = self.scheduler.register(q.rid, size, r.projected, full, fetch, expected)
            q.drafted_at = self.now
        self._changed()

    def _stream(self, q: SimRequest, r: Round) -> None:
        accepted = min(r.acceptance_length, q.max_tokens - q.emitted)
        assert q.acceptance is not None
        q.acceptance.observe(r.tokens, r.acceptance_length - 1)
        q.rounds += 1
        q.unseen += accepted
        q.lengths.append(accepted)
        actual = union_bytes(r.actual, self.s.byte_map)
        q.coverage.append(union_bytes(r.actual & r.projected, self.s.byte_map) / actual if actual else 1.0)
        q.pending, q.ticket = None, None
        if q.claim is not None and self.cache is not None:
            self.cache.release(q.claim)
        q.claim = None
        self._emit(q, accepted)
        if q.emitted >= q.max_tokens:
            self._exit(q)
        else:
            self._plan(q)

    def _emit(self, q: SimRequest, tokens: int) -> None:
        q.emitted += tokens
        q.times.append(self.now)
        q.tokens.append(tokens)

    # -- the pacer --
    def _changed(self) -> None:
        """A demand registered or a sequence left: serve if the target lane has no batch, else
        tick once for the next batch (once no sequence still drafts toward the tick)."""
        if self._running is None:
            self._serve()
        else:
            self._tick_during(self._running)

    def _serve(self) -> None:
        """VerifyPacer.serve, one pass: launch the admitted batch, or tick for one, once gathered."""
        if not self.s.pipelined and any(q.ticket is None for q in self.seated.values()):
            return  # lock-step: a step's tick follows its prefills and every sequence's draft
        if self._held is None:  # a new pass: take what the last tick admitted
            self._held, self._waited = [q for q in self._next if q.pending is not None], False
            self._next = []
        batch = self._held
        if not batch and not (self.scheduler.pending_count() or self.scheduler.admitted_ids()):
            self._held = None  # nothing to launch: the next registration serves again
            return
        wait_s = self._gather_s(batch)
        if wait_s > 0:  # sequences still drafting would share this batch's experts: wait for them
            self._waited = True
            self.clock.at(self.now + wait_s, self._serve_if_idle)
            return
        self._held = None
        if batch and self._waited:
            batch = batch + self._tick(frozenset())  # latecomers join the gathered batch
        for _ in range(STALLED_TICKS):
            if batch or not (self.scheduler.pending_count() or self.scheduler.admitted_ids()):
                break
            batch = self._tick(frozenset())  # nothing fits yet: the carried quantum grows each tick
        else:
            raise SimulationError(f"{STALLED_TICKS} ticks admitted nothing with nothing running ({self.s.config.name})")
        if batch:
            self._launch(batch)

    def _serve_if_idle(self) -> None:
        if self._running is None:
            self._serve()

    def _gather_s(self, batch: list[SimRequest]) -> float:
        """VerifyPacer._gather_s: how long a launch may still wait for sequences drafting (0: go).

        With a link, while other sequences draft toward a demand: as long as the link is busy
        with `batch`'s copies, or until their drafts are due (the drafter's measured seconds per
        sequence); never without one (resident), nor in the lock-step engine."""
        if self.cache is None or not self.s.pipelined:
            return 0.0
        coming = sum(1 for q in self.seated.values() if q.acceptance is not None and q.ticket is None)
        if not coming:
            return 0.0
        waiting = batch + [q for q in self.seated.values() if q.ticket is not None and not q.ticket.admitted]
        if not waiting:
            return 0.0
        prefetching = frozenset().union(*(_round(q).projected for q in batch))
        copying_s = union_bytes(prefetching - self.cache.resident(), self.s.byte_map) / self.s.link_bytes_per_s
        drafts_due = max(q.drafted_at for q in waiting) + coming * self.planner.draft_s
        return max(0.0, copying_s, drafts_due - self.now)

    def _tick_during(self, batch: list[SimRequest]) -> None:
        """While `batch` runs: one tick for the next batch, as soon as demands wait and it is gathered."""
        if self._running is not batch or not self.s.pipelined or self._ticked or not self.scheduler.pending_count():
            return
        wait_s = self._gather_s([])
        if wait_s > 0:
            self.clock.at(self.now + wait_s, lambda: self._tick_during(batch))
            return
        self._next, self._ticked = self._tick(self._running_union), True

    def _launch(self, batch: list[SimRequest]) -> None:
        self._running, self._ticked = batch, False
        self.verify_batches[len(batch)] = self.verify_batches.get(len(batch), 0) + 1
        self._running_union = frozenset().union(*(_round(q).projected for q in batch))
        launched = self.now
        exposed = self.cache.counters.exposed_fetch_s if self.cache is not None else 0.0
        self.target.submit(lambda: self._verify_job(batch), lambda _: self._verified(batch, launched, exposed))
        self._tick_during(batch)

    def _tick(self, in_flight: frozenset[ExpertKey]) -> list[SimRequest]:
        self.ticks_in_flight += bool(in_flight)
        resident = self.cache.resident() if self.cache is not None else frozenset()
        budget = self.derived.per_tick() if self.derived is not None else None
        self.scheduler.tick(resident, in_flight, budget=budget)
        admitted = [self.seated[cast(int, i)] for i in self.scheduler.admitted_ids()]
        for q in admitted:
            self.scheduler.mark_in_flight(q.rid)
            q.wait_s += self.now - q.drafted_at
            if self.cache is not None:
                q.claim = self.cache.prefetch(_round(q).projected, self.now)
        return admitted

    def _verify_job(self, batch: list[SimRequest]) -> Job:
        yield self.now + self.s.costs.step_s(len(self.seated))  # the engine's bookkeeping per launch
        rounds = [_round(q) for q in batch]
        unions = [r.actual for r in rounds]
        experts = len(frozenset().union(*unions))
        tokens = sum(r.tokens for r in rounds)
        yield from self._forward(unions, *self.s.costs.verify_s(tokens, len(batch), experts, offloaded=self._offl))

    def _verified(self, batch: list[SimRequest], launched: float, exposed: float) -> None:
        """As VerifyPacer._verify: finish the demands, teach the planner, then each sequence streams."""
        waited = (self.cache.counters.exposed_fetch_s if self.cache is not None else 0.0) - exposed
        rounds = [_round(q) for q in batch]
        known = all(r.positions for r in rounds)
        positions = (
            position_fetch_bytes([q.resident for q in batch], [r.positions for r in rounds], self.s.byte_map)
            if known
            else [()] * len(batch)
        )
        traces = [self._trace(r, p) for r, p in zip(rounds, positions, strict=True)]
        for q in batch:
            self.scheduler.finish(q.rid)
        self.planner.observe_verify(traces, max(0.0, self.now - launched - waited))
        self._running = None
        for q, r in zip(batch, rounds, strict=True):
            self._stream(q, r)
        # the pacer launches its next batch after the sequences' follow-up rounds were submitted
        # (measured on the engine: a plain round of batch N reaches the target lane before N+1's verify)
        self.clock.at(self.now, self._serve_if_idle)

    def _trace(self, r: Round, positions: tuple[int, ...]) -> RoundTrace:
        nbytes = self.s.byte_map
        return RoundTrace(
            start=0,
            tokens=r.tokens,
            acceptance_length=r.acceptance_length,
            expert_bytes=union_bytes(r.projected, nbytes),
            fetch_bytes=0,
            actual_bytes=union_bytes(r.actual, nbytes),
            quality=ProjectionQuality.compare(r.projected, r.actual, nbytes),
            position_fetch_bytes=positions,
        )

    # -- results --
    def records(self) -> list[RequestRecord]:
        return [
            RequestRecord(
                arrived_s=q.arrived_s,
                first_token_s=q.times[0],
                finished_s=q.times[-1],
                delta_times_s=tuple(q.times),
                delta_tokens=tuple(q.tokens),
                acceptance_lengths=tuple(q.lengths),
                admission_wait_s=q.wait_s,
                projection_coverage_bytes=sum(q.coverage) / len(q.coverage) if q.coverage else None,
            )
            for q in sorted(self.done, key=lambda q: q.rid)
        ]

    def traffic(self) -> Traffic:
        c = self.cache.counters if self.cache is not None else None
        return Traffic(
            expert_bytes_fetched=c.expert_bytes_fetched if c else 0,
            hit_bytes=c.hit_bytes if c else 0,
            miss_bytes=c.miss_bytes if c else 0,
            exposed_fetch_s=c.exposed_fetch_s if c else 0.0,
            model_s=self.target.busy_s + (self.drafter.busy_s if self.drafter is not self.target else 0.0),
        )
