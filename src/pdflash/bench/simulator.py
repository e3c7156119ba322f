"""`pdflash simulate`: the engine's step loop as a discrete-event run on a virtual clock.

Owns the simulated step (prefill newcomers -> draft every DRAFT sequence -> one admission
tick -> route-ahead prefetch -> one batched verify, as AsyncEngine._step does), closed-loop
and Poisson clients, and the per-request records. The REAL `VerifyScheduler` admits verifies
(on this clock) and the REAL eviction policies choose victims (in SimCache); only forwards
(a CostModel) and the link (SimCache's serial copy engine) are modelled, and routing comes
from a RoutingSource. Must not touch engines or tensors.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence

import anyio
import attrs

from pdflash.bench.configs import BenchConfig
from pdflash.bench.costs import CostModel
from pdflash.bench.metrics import PointResult, RequestRecord, Traffic, summarise
from pdflash.bench.routing import Round, RoutingSource
from pdflash.bench.sim_cache import SimCache
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.engine.ticket import Ticket
from pdflash.target.experts import ExpertKey


@attrs.frozen(kw_only=True)
class SimSetup:
    """Everything one simulated point needs besides its clients."""

    config: BenchConfig
    costs: CostModel
    routing: RoutingSource
    byte_map: Mapping[ExpertKey, int]  # bytes per (layer, expert), as stored
    moe_layers: tuple[int, ...]
    block_size: int  # the drafter's block (1 is used for autoregressive configurations)
    cache_slots: int  # experts the device cache holds (offloaded configurations)
    link_bytes_per_s: float  # the copy engine's rate
    policy: str = "activation"
    max_num_seqs: int = 64
    prefill_token_budget: int = 4096
    budgets: dict | None = None  # the four verify_* budgets of a 2-D configuration


@attrs.define(eq=False)
class _Seq:
    rid: int  # request number, the scheduler's seq id
    route: int  # routing sequence (prompt index)
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    client: int | None
    emitted: int = 0
    rounds: int = 0
    drafted_at: float = 0.0
    pending: Round | None = None  # the drafted round awaiting its verify
    ticket: Ticket | None = None
    times: list[float] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    lengths: list[int] = attrs.Factory(list)
    wait_s: float = 0.0
    coverage: list[float] = attrs.Factory(list)


def _round(q: _Seq) -> Round:
    assert q.pending is not None, f"request {q.rid} has no drafted round"
    return q.pending


class Simulator:
    """One point: its clients, the virtual clock, the real scheduler and the simulated cache."""

    def __init__(self, setup: SimSetup, max_tokens: int) -> None:
        self.s = setup
        self.max_tokens = max_tokens  # per request, unless its replayed trace ended sooner
        self.now = 0.0
        cfg = setup.config
        self.block = setup.block_size if cfg.speculative else 1
        self.cache = (
            SimCache(
                setup.byte_map, slots=setup.cache_slots, link_bytes_per_s=setup.link_bytes_per_s, policy=setup.policy
            )
            if cfg.offloaded
            else None
        )
        if not cfg.simulated:
            raise ValueError(
                f"the simulator does not model {cfg.name} (adaptive blocks or budgets derived per tick); "
                "use ar, dflash-token, dflash-2d or resident"
            )
        if cfg.two_dimensional:
            b = setup.budgets or {}
            self.scheduler = VerifyScheduler(
                token_budget=b["verify_token_budget"],
                token_cap=b["verify_token_cap"],
                byte_budget=b["verify_byte_budget"],
                byte_cap=b["verify_byte_cap"],
                byte_map=setup.byte_map,
                clock=lambda: self.now,
            )
        else:
            budget = setup.max_num_seqs * self.block
            self.scheduler = VerifyScheduler(token_budget=budget, token_cap=budget, clock=lambda: self.now)
        self.router = cfg.offloaded or cfg.two_dimensional  # the engine's default projector choice
        self.model_s = 0.0
        self.waiting: list[_Seq] = []
        self.live: list[_Seq] = []
        self.done: list[_Seq] = []

    # -- forwards --
    def _forward(self, unions: Sequence[frozenset[ExpertKey]], dense_s: float, expert_s: float) -> None:
        """A target forward layer by layer: attention and routing, then the MoE block, which asks
        for its missing experts and computes in waves as they land (the last wave after the last
        copy), as OffloadedExperts.waves serves a forward."""
        started = self.now
        if self.cache is None:
            self.now += dense_s + expert_s
        else:
            dense_l, expert_l = dense_s / len(self.s.moe_layers), expert_s / len(self.s.moe_layers)
            by_layer: dict[int, set[int]] = {layer: set() for layer in self.s.moe_layers}
            for union in unions:
                for layer, expert in union:
                    by_layer[layer].add(expert)
            for layer in self.s.moe_layers:
                self.now += dense_l
                experts = by_layer[layer]
                held, ready = self.cache.acquire(layer, experts, self.now)
                done = max(self.now + expert_l, ready + expert_l / max(1, len(experts)))
                self.cache.counters.exposed_fetch_s += done - self.now - expert_l
                self.now = done
                self.cache.release(held)
        self.model_s += self.now - started

    # -- the step --
    def step(self) -> None:
        self.now += self.s.costs.step_s(len(self.live))
        self._prefill()
        self._draft()
        admitted = self._admit()
        if admitted and self.cache is not None:
            self.cache.prefetch(frozenset().union(*(_round(q).projected for q in admitted)), self.now)
        self._verify(admitted)

    def _prefill(self) -> None:
        batch: list[_Seq] = []
        tokens = 0
        while self.waiting and len(self.live) + len(batch) < self.s.max_num_seqs:
            q = self.waiting[0]
            if batch and tokens + q.prompt_tokens > self.s.prefill_token_budget:
                break
            batch.append(self.waiting.pop(0))
            tokens += q.prompt_tokens
        if not batch:
            return
        unions = [self.s.routing.prefill_union(q.route, q.prompt_tokens) for q in batch]
        experts = len(frozenset().union(*unions))
        self._forward(unions, *self.s.costs.prefill_s(tokens, len(batch), experts, offloaded=self.cache is not None))
        for q in batch:
            self._emit(q, 1)
            if q.emitted < q.max_tokens:
                self.live.append(q)

    def _draft(self) -> None:
        batch = [q for q in self.live if q.pending is None]
        if not batch:
            return
        sizes = [min(self.block, q.max_tokens - q.emitted + 1) for q in batch]
        context = sum(q.lengths[-1] if q.lengths else q.prompt_tokens for q in batch)  # features not yet drafted on
        started = self.now
        self.now += self.s.costs.draft_s(
            len(batch), sum(sizes), context, speculative=self.s.config.speculative, router=self.router
        )
        self.model_s += self.now - started
        resident = self.cache.resident() if self.cache is not None else frozenset()
        for q, size in zip(batch, sizes, strict=True):
            q.pending = self.s.routing.round(q.route, q.rounds, size)
            union = q.pending.projected
            full = sum(self.s.byte_map[k] for k in union)
            fetch = sum(self.s.byte_map[k] for k in union - resident)
            q.ticket = self.scheduler.register(q.rid, size, union, full, fetch)
            q.drafted_at = self.now

    def _admit(self) -> list[_Seq]:
        if self.scheduler.pending_count():
            resident = self.cache.resident() if self.cache is not None else frozenset()
            self.scheduler.tick(resident, frozenset())
        admitted = [q for q in self.live if q.ticket is not None and q.ticket.admitted]
        for q in admitted:
            self.scheduler.mark_in_flight(q.rid)
            q.wait_s += self.now - q.drafted_at
        return admitted

    def _verify(self, batch: list[_Seq]) -> None:
        if not batch:
            return
        tokens = sum(_round(q).tokens for q in batch)
        unions = [_round(q).actual for q in batch]
        experts = len(frozenset().union(*unions))
        self._forward(unions, *self.s.costs.verify_s(tokens, len(batch), experts, offloaded=self.cache is not None))
        for q in batch:
            self.scheduler.finish(q.rid)
            r, q.pending, q.ticket = _round(q), None, None
            accepted = min(r.acceptance_length, q.max_tokens - q.emitted)
            q.rounds += 1
            q.lengths.append(accepted)
            actual = sum(self.s.byte_map[k] for k in r.actual)
            q.coverage.append(sum(self.s.byte_map[k] for k in r.actual & r.projected) / actual if actual else 1.0)
            self._emit(q, accepted)
            if q.emitted >= q.max_tokens:
                self.live.remove(q)

    def _emit(self, q: _Seq, tokens: int) -> None:
        q.emitted += tokens
        q.times.append(self.now)
        q.tokens.append(tokens)
        if q.emitted >= q.max_tokens:
            self.done.append(q)

    # -- clients --
    def run(self, arrivals: list[tuple[float, int, int, int, int | None]], follow_ups: dict) -> None:
        """`arrivals`: (time, rid, route, prompt_tokens, client) known up front; `follow_ups`:
        client -> list of (route, prompt_tokens) it sends after each finished request."""
        pending = list(arrivals)
        heapq.heapify(pending)
        rids = itertools.count(len(arrivals))
        limit = getattr(self.s.routing, "output_tokens", lambda route: None)
        while pending or self.waiting or self.live:
            while pending and pending[0][0] <= self.now:
                t, rid, route, prompt, client = heapq.heappop(pending)
                tokens = min(self.max_tokens, limit(route) or self.max_tokens)
                self.waiting.append(_Seq(rid, route, prompt, tokens, t, client))
            if not self.waiting and not self.live:
                self.now = pending[0][0]
                continue
            finished = len(self.done)
            self.step()
            for q in self.done[finished:]:
                queue = follow_ups.get(q.client)
                if queue:
                    route, prompt = queue.pop(0)
                    heapq.heappush(pending, (self.now, next(rids), route, prompt, q.client))

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
            model_s=self.model_s,
        )


def simulate_closed_loop(
    setup: SimSetup, prompt_tokens: Sequence[int], *, concurrency: int, requests_per_client: int, max_tokens: int
) -> PointResult:
    """`concurrency` clients, each sending `requests_per_client` requests back to back (prompt
    i of client c is prompt (c * requests_per_client + i) mod n, as `pdflash bench` assigns them)."""
    n = len(prompt_tokens)
    first, follow = [], {}
    for c in range(concurrency):
        routes = [(c * requests_per_client + r) % n for r in range(requests_per_client)]
        first.append((0.0, c, routes[0], prompt_tokens[routes[0]], c))
        follow[c] = [(r, prompt_tokens[r]) for r in routes[1:]]
    return _run(setup, first, follow, concurrency, max_tokens)


def simulate_open_loop(
    setup: SimSetup, prompt_tokens: Sequence[int], *, arrival_times_s: Sequence[float], max_tokens: int
) -> PointResult:
    """Requests arriving at the given times (a Poisson process, say), prompt i mod n each."""
    n = len(prompt_tokens)
    arrivals = [(t, i, i % n, prompt_tokens[i % n], None) for i, t in enumerate(arrival_times_s)]
    return _run(setup, arrivals, {}, 0, max_tokens)


def _run(setup: SimSetup, arrivals, follow, concurrency: int, max_tokens: int) -> PointResult:
    sim = Simulator(setup, max_tokens)

    async def body() -> None:  # scheduler tickets are anyio events: they need a running loop
        sim.run(arrivals, follow)

    anyio.run(body)
    return summarise(
        setup.config.name,
        concurrency,
        sim.records(),
        sim.traffic(),
        sim.now,
        routing=setup.routing.description,
        costs=setup.costs.description,
        simulated=True,
    )
