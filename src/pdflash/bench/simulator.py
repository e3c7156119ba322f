"""`pdflash simulate`: the pipelined engine as a discrete-event run on a virtual clock.

Owns the simulated engine's sequences and lanes: one flow per sequence (prefill, then plan ->
draft -> register -> admission -> verify -> stream, as AsyncEngine._serve), the lanes it runs
on (target: prefill, plain-decoding rounds, verifies; drafter: drafted blocks; the cache's
copy engine: every expert copy), seats, and the layer-by-layer forward that waits for its
experts. When ticks run and what a verify launch holds is pdflash.bench.sim_pacer's (as
pdflash.engine.pacer.VerifyPacer), so batch N+1's copies run during batch N's compute and
wall time is what that schedule gives. The engine's own pieces decide: the REAL
VerifyScheduler built by EngineConfig.verify_scheduler, DerivedBudgets, the offer order, the
SpeculationPlanner with the speculation policy and acceptance estimates, and the eviction
policies (in SimCache). Only forwards (a CostModel), the link (bytes / rate) and routing (a
RoutingSource) are modelled; clients and the point's result are pdflash.bench.sim_clients'.
Must not touch engines or tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from pdflash.bench.configs import BenchConfig
from pdflash.bench.costs import CostModel
from pdflash.bench.metrics import RequestRecord, Traffic
from pdflash.bench.routing import Round, RoutingSource
from pdflash.bench.sim_cache import SimCache, SimClaim, SimulationError
from pdflash.bench.sim_confidence import SimConfidence
from pdflash.bench.sim_events import Clock, Job, SimBatchLane, SimLane
from pdflash.bench.sim_pacer import SimPacer
from pdflash.engine.config import EngineConfig
from pdflash.engine.pacer import DerivedBudgets
from pdflash.engine.prefill_mode import prefill_waits_for_verify, prefills_ride_verifies
from pdflash.engine.seating import prefill_waits, seconds_to_limit
from pdflash.engine.speculation import RoutingShape, SpeculationPlanner
from pdflash.engine.ticket import Ticket
from pdflash.spec.acceptance import SequenceAcceptance
from pdflash.spec.policy import VerifyCut
from pdflash.spec.projection import union_bytes
from pdflash.target.experts import ExpertKey


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
    prefill_mode: str = "auto"  # EngineConfig.prefill_mode (the lock-step engine always prefilled alone)
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
    drafting: int = 1  # tokens the drafter makes for it (SpeculationPlanner.drafted_tokens; 1: none)
    shadowed: int | None = None  # drafts of the whole block it drafted that a verify would accept
    cut: VerifyCut | None = None  # how the round's drafts are cut once made (SpeculationPlanner.cut)
    confidence: tuple[float, ...] = ()  # [made - 1]: the drafter's confidence in each draft (SimConfidence)
    expected: float = 1.0  # its pending round's E[committed]: by its drafts' confidence, else its mean estimate
    pending: Round | None = None  # the drafted round awaiting its verify
    resident: frozenset[ExpertKey] = frozenset()  # resident when it was drafted
    ticket: Ticket | None = None
    claim: SimClaim | None = None  # its route-ahead prefetch's claim
    anchor_claim: SimClaim | None = None  # the claim on its next anchor's experts (until that round's verify ran)
    anchor_fetch: frozenset[ExpertKey] = frozenset()  # what that claim fetched (its next round's bytes)
    drafted_at: float = 0.0
    verified_at: float = 0.0  # when its last verify ended (0: none yet)
    times: list[float] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    lengths: list[int] = attrs.Factory(list)
    wait_s: float = 0.0
    coverage: list[float] = attrs.Factory(list)


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
            RoutingShape.of(setup.byte_map, setup.top_k),
        )
        # the engine cuts greedy drafted blocks by the drafter's confidence (the pipelined engine's)
        self.confidence = SimConfidence.bundled() if setup.pipelined and cfg.speculative else None
        self.router = cfg.offloaded or cfg.two_dimensional  # the engine's default projector choice
        # each verify projects its sequences' next anchors, as the engine does behind a link with a
        # projector that never runs the target (the route head): a plain round after it needs no
        # lane (Speculator.plain_round), and a drafting sequence's anchor is prefetched while it drafts
        self.projects_anchors = (
            setup.pipelined and cfg.offloaded and cfg.projector in (None, "route-head", "last-union")
        )
        self.anchors = self.projects_anchors and cfg.speculative
        self._plain_known: list[SimRequest] = []  # plain rounds whose projection the verify made, to register
        # prompts prefill inside the next batched verify (pdflash.engine.prefill_mode)
        self.prefills_ride = setup.pipelined and prefills_ride_verifies(
            setup.prefill_mode, offloaded=cfg.offloaded, drafts=cfg.speculative
        )
        self.target = SimLane(self.clock, "target")
        self.drafter = SimLane(self.clock, "drafter") if setup.pipelined else self.target
        self.prefill = SimBatchLane(
            self.target,
            self._prefill_job,
            self.prefilled,
            cost=lambda q: q.prompt_tokens,
            max_cost=setup.prefill_token_budget,
            hold=self._prefill_waits_for_verify,
        )
        self.draft = SimBatchLane(self.drafter, self._draft_job, self._drafted)
        self.plain = SimBatchLane(self.target, self._plain_job, self._drafted)
        self.waiting: list[SimRequest] = []
        self.seated: dict[int, SimRequest] = {}  # by request id: prefilling or in rounds
        self.done: list[SimRequest] = []
        self.on_finish = lambda q: None  # the clients' hook: a finished request may send the next
        self.pacer = SimPacer(self)
        self.prefill_s: float | None = None  # what the last batched prefill took (RoundWork.prefill_s)

    @property
    def now(self) -> float:
        return self.clock.now

    # -- arrivals and seats --
    def arrive(self, q: SimRequest) -> None:
        self.waiting.append(q)
        self._seat()

    def _seat(self) -> None:
        while self.waiting and len(self.seated) < self.s.max_num_seqs:
            if self._prefill_waits():  # AsyncEngine._seat_waiting: the next exit offers the seats again
                return
            q = self.waiting.pop(0)
            self.seated[q.rid] = q
            self.prefill.submit(q)

    def _prefill_waits(self) -> bool:
        return prefill_waits(
            link=self.cache is not None,
            prefill_s=self.prefill_s,
            to_limit_s=(
                seconds_to_limit(q.max_tokens - q.emitted, q.emitted, self.now - q.times[0])
                for q in self.seated.values()
                if q.acceptance is not None  # in rounds (prefilled)
            ),
        )

    def _prefill_waits_for_verify(self) -> bool:
        in_rounds = sum(q.acceptance is not None for q in self.seated.values())
        return prefill_waits_for_verify(rides=self.prefills_ride, sequences_in_rounds=in_rounds)

    def _exit(self, q: SimRequest) -> None:
        self.drop_anchor_claim(q)
        self.done.append(q)
        del self.seated[q.rid]
        self.on_finish(q)
        self._seat()
        self.prefill.release()  # one fewer sequence in rounds a waiting prefill may wait for
        self.pacer.changed()  # one fewer sequence a gathering launch may wait for

    # -- forwards (lane jobs) --
    def forward(
        self, unions: Sequence[frozenset[ExpertKey]], dense_s: float, expert_s: float, claims: Sequence[SimClaim] = ()
    ) -> Job:
        """A target forward layer by layer: attention and routing, then the MoE block, which asks
        for its missing experts and computes in waves as they land (the last wave after the last
        copy), as OffloadedExperts.waves serves a forward; a verify's `claims` end layer by layer."""
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
            self.cache.pass_layer(layer, claims)

    def prefill_unions(self, batch: list[SimRequest]) -> list[frozenset[ExpertKey]]:
        return [self.s.routing.prefill_union(q.route, q.prompt_tokens) for q in batch]

    def _prefill_job(self, batch: list[SimRequest]) -> Job:
        started = self.now
        tokens = sum(q.prompt_tokens for q in batch)
        unions = self.prefill_unions(batch)
        experts = len(frozenset().union(*unions))
        yield from self.forward(unions, *self.s.costs.prefill_s(tokens, len(batch), experts, offloaded=self.offloaded))
        self.prefill_s = self.now - started

    def _draft_job(self, batch: list[SimRequest]) -> Job:
        """The drafter lane: drafter forward and route projection of blocks of 2 or more."""
        sizes = [min(q.planned, q.max_tokens - q.emitted + 1) for q in batch]
        made = [min(q.drafting, q.max_tokens - q.emitted + 1) for q in batch]
        drafting = [q for q, n in zip(batch, made, strict=True) if n >= 2]
        context = sum(q.unseen for q in drafting)
        seconds = self.s.costs.draft_s(len(batch), sum(made), context, speculative=bool(drafting), router=self.router)
        yield self.now + seconds
        # RoundWork.draft_rounds: a batch in which a sequence catches up on skipped context is not timed
        if all(q.unseen <= self.block for q in drafting):
            self.planner.observe_draft(len(drafting), seconds)
        return sizes

    def _plain_job(self, batch: list[SimRequest]) -> Job:
        """The target lane: plain-decoding rounds (a block of 1: the route projection only)."""
        yield self.now + self.s.costs.draft_s(len(batch), len(batch), 0, speculative=False, router=self.router)
        return [1] * len(batch)

    @property
    def offloaded(self) -> bool:
        return self.cache is not None

    # -- one sequence's flow --
    def prefilled(self, batch: list[SimRequest], _: object = None) -> None:
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
        q.planned = self.planner.plan(q.acceptance, greedy=True)
        q.drafting = self.planner.drafted_tokens(q.planned, greedy=True)
        q.cut = self.planner.cut(q.acceptance, q.planned, greedy=True) if self.confidence is not None else None
        if q.drafting > 1:
            self.draft.submit(q)
        elif self.projects_anchors and q.rounds > 0:  # the verify before projected its anchor: no lane
            if not self._plain_known:  # those of one verify register together, after its streams
                self.clock.at(self.now, self._register_plain)
            self._plain_known.append(q)
        else:
            self.plain.submit(q)

    def _register_plain(self) -> None:
        known, self._plain_known = self._plain_known, []
        self._drafted(known, [1] * len(known))

    def _drafted(self, batch: list[SimRequest], sizes: list[int]) -> None:
        resident = self.cache.resident() if self.cache is not None else frozenset()
        for q, size in zip(batch, sizes, strict=True):
            q.shadowed, q.confidence = None, ()
            if q.drafting >= 2:  # the drafter ran: what its whole block would have been accepted as
                q.unseen = 0
                made = min(q.drafting, q.max_tokens - q.emitted + 1)
                q.shadowed = self.s.routing.round(q.route, q.rounds, made, q.emitted - 1).acceptance_length - 1
                if q.cut is not None and self.confidence is not None and made >= 2:  # cut as the drafter lane does
                    q.confidence = self.confidence.draw(made - 1, q.shadowed, q.route, q.rounds)
                    size = q.cut.block(q.confidence)
            r = q.pending = self.s.routing.round(q.route, q.rounds, size, q.emitted - 1)
            q.resident = resident - q.anchor_fetch
            expected = q.expected = (
                self.planner.expected_tokens(q.acceptance, size, q.confidence) if q.acceptance is not None else 1.0
            )
            full = union_bytes(r.projected, self.s.byte_map)
            fetch = union_bytes(r.projected - resident, self.s.byte_map)
            q.ticket = self.scheduler.register(q.rid, size, r.projected, full, fetch, expected)
            q.drafted_at = self.now
        self.pacer.changed()

    def stream(self, q: SimRequest, r: Round) -> None:
        accepted = min(r.acceptance_length, q.max_tokens - q.emitted)
        assert q.acceptance is not None
        # as the engine's ShadowReader, told at once: the shadow drafts' outcome when every verified
        # draft passed, else the verify's (the engine reads shadow drafts over the next rounds)
        q.acceptance.round_passed()
        if q.shadowed is not None and r.acceptance_length == r.tokens:
            q.acceptance.record(min(q.drafting, q.max_tokens - q.emitted + 1), q.shadowed)
        else:
            q.acceptance.record(r.tokens, r.acceptance_length - 1)
        if r.tokens >= 2:
            self.planner.observe_committed(q.expected, r.acceptance_length)
            self.planner.observe_drafts(q.confidence, r.tokens, r.acceptance_length - 1)
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

    def next_anchor(self, q: SimRequest, r: Round) -> Round | None:
        """Its next round's anchor alone, as the verify of `r` leaves it (None: it finishes, its
        round did not draft, anchors are not prefetched here, or the routing source does not
        know single tokens' routes): the routing source's round of one token there."""
        emitted = q.emitted + min(r.acceptance_length, q.max_tokens - q.emitted)
        if not self.anchors or emitted >= q.max_tokens or q.drafting < 2:  # as the engine: drafted rounds only
            return None
        anchor = self.s.routing.round(q.route, q.rounds + 1, 1, emitted - 1)
        # a replay of recorded whole blocks knows no token's route alone (its round of one token is
        # the whole next block's): there the anchors' prefetch is left out rather than overstated
        return anchor if anchor.positions else None

    def drop_anchor_claim(self, q: SimRequest) -> None:
        if q.anchor_claim is not None and self.cache is not None:
            self.cache.release(q.anchor_claim)
        q.anchor_claim, q.anchor_fetch = None, frozenset()

    def _emit(self, q: SimRequest, tokens: int) -> None:
        q.emitted += tokens
        q.times.append(self.now)
        q.tokens.append(tokens)

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
            link_busy_s=c.link_busy_s if c else 0.0,
            model_s=self.target.busy_s + (self.drafter.busy_s if self.drafter is not self.target else 0.0),
        )
