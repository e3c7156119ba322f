"""What `AsyncEngine.stats()` reports: the engine's running totals and the snapshot built from them.

Owns the counters the engine bumps as requests come, stream and leave (`Totals`) and the
frozen `EngineStats` snapshot, assembled from the engine's sequences, its scheduler, pacer,
lanes, planner and expert provider. Reads only; changes nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import attrs

from pdflash.measure import overlap_s

if TYPE_CHECKING:
    from pdflash.engine.async_engine import AsyncEngine


@attrs.define
class Totals:
    """Requests and rounds since the engine started."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    verify_rounds: int = 0
    verify_tokens: int = 0
    prefills_held: int = 0  # requests whose prefill waited for a sequence about to leave (pdflash.engine.seating)


@attrs.frozen(kw_only=True)
class EngineStats:
    live_sequences: int  # admitted and not yet released (holding KV)
    sequences_by_state: dict[str, int]  # sequences not yet released, by lifecycle state
    waiting: int  # queued, not yet admitted
    pending_demands: int  # verify demands the scheduler holds (waiting or in flight)
    kv_bytes: int  # target + drafter KV cache bytes held by live sessions
    claimed_experts: int  # experts of route-ahead prefetches (rounds' and next anchors') still claimed
    requests: int  # accepted by generate()
    finished: int
    aborted: int
    failed: int
    generated_tokens: int  # tokens streamed, all requests
    verify_rounds: int  # per-sequence verify rounds
    prefills_held: int  # requests whose prefill waited for a sequence about to leave (pdflash.engine.seating)
    prefill_mode: str  # "verify" (prompts prefill inside batched verifies) | "alone" (pdflash.engine.prefill_mode)
    prefills_in_verifies: int  # prompts prefilled inside a batched verify's forward
    scheduling: str  # "fixed" | "derived" | "token-only": how verify budgets were set
    ticks: int  # admission ticks run (at most one per verify launch while the lane is busy)
    in_flight_tick_share: float  # share of ticks charged against a non-empty in-flight union
    mean_acceptance_length: float  # tokens emitted per verify round, bonus included
    speculation: str  # "adaptive" | "fixed" (always "fixed" without a drafter)
    drafter_lane: str | None  # "own" (drafts beside verifies) | "shared" (the target's lane) | None: no drafter
    block_decisions: dict[int, int]  # verify block length chosen -> rounds
    drafts_vetoed: int  # rounds the policy would have drafted, kept plain: blocks realized less (planner)
    verify_batch_sizes: dict[int, int]  # sequences per batched verify -> how many such batches
    admission_wait_p50_s: float | None  # verify admission wait (scheduler window)
    admission_wait_p99_s: float | None
    model_s: float  # time the target and drafter lanes spent in forwards (summed: overlapping lanes count twice)
    busy_s: float  # wall time with a forward (either lane) or an expert copy running: the union, counted once
    copy_compute_overlap_s: float  # time expert copies ran while the target lane computed
    prefetch_requests: int  # route-ahead prefetches issued
    anchor_prefetches: int  # of them, a verified sequence's next anchor, fetched while it drafts
    prefetch_errors: int
    provider: dict | None  # the expert provider's own stats, if it has any

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def engine_stats(engine: AsyncEngine) -> EngineStats:
    """A snapshot of `engine` (cheap: no model work, no locks held for long)."""
    t, sched, running = engine._totals, engine.scheduler.stats(), engine._running
    pacer = running.pacer.stats if running is not None else None
    lanes = [lane for lane in (running.target, running.drafter) if lane is not None] if running else []
    copies = engine.provider.copy_intervals() if engine.provider is not None and running is not None else []
    return EngineStats(
        live_sequences=len(engine._seqs) - len(engine._waiting),
        sequences_by_state=dict(Counter(s.state.value for s in engine._seqs.values())),
        waiting=len(engine._waiting),
        pending_demands=sched.pending + sched.in_flight,
        kv_bytes=sum(s.kv_bytes for s in engine._seqs.values()),
        claimed_experts=len(
            frozenset().union(*(c.keys for s in engine._seqs.values() for c in (s.claim, s.anchor_claim) if c))
        ),
        requests=t.requests,
        finished=t.finished,
        aborted=t.aborted,
        failed=t.failed,
        generated_tokens=t.tokens,
        verify_rounds=t.verify_rounds,
        prefills_held=t.prefills_held,
        prefill_mode="verify" if engine.prefills_ride else "alone",
        prefills_in_verifies=pacer.prefills_in_verifies if pacer else 0,
        scheduling=engine.scheduling,
        ticks=sched.ticks,
        in_flight_tick_share=pacer.ticks_in_flight / pacer.ticks if pacer and pacer.ticks else 0.0,
        mean_acceptance_length=t.verify_tokens / t.verify_rounds if t.verify_rounds else 0.0,
        speculation=engine.planner.mode,
        drafter_lane=engine.drafter_lane,
        block_decisions=dict(sorted(engine.planner.decisions.items())),
        drafts_vetoed=engine.planner.vetoed,
        verify_batch_sizes=dict(sorted(running.pacer.verify_batches.items())) if running else {},
        admission_wait_p50_s=sched.wait_p50_s,
        admission_wait_p99_s=sched.wait_p99_s,
        model_s=sum(lane.busy_s for lane in lanes),
        busy_s=running.busy.busy_s(time.perf_counter()) if running else 0.0,
        copy_compute_overlap_s=overlap_s(copies, running.target.intervals) if running else 0.0,
        prefetch_requests=pacer.prefetch_requests if pacer else 0,
        anchor_prefetches=pacer.anchor_prefetches if pacer else 0,
        prefetch_errors=pacer.prefetch_errors if pacer else 0,
        provider=engine.provider.stats() if engine.provider is not None else None,
    )
