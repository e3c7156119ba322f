"""Figures of one sweep point, measured or simulated: per-request records in, one PointResult out.

Owns the arithmetic that turns request timings and traffic counters into the reported
metrics (percentiles, Jain's fairness, shares of wall time). Must not run engines or
simulations; runners fill `RequestRecord`s and `Traffic` and call `summarise`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs


@attrs.frozen(kw_only=True)
class RequestRecord:
    """One request as its client saw it (seconds on the run's clock)."""

    arrived_s: float
    first_token_s: float  # when its first delta arrived
    finished_s: float
    delta_times_s: tuple[float, ...]  # arrival time of each delta
    delta_tokens: tuple[int, ...]  # tokens each delta carried
    acceptance_lengths: tuple[int, ...]  # tokens per verify round, bonus included
    admission_wait_s: float  # Σ over its rounds of the wait for verify admission
    projection_coverage_bytes: float | None  # mean over its rounds; None without projection

    @property
    def tokens(self) -> int:
        return sum(self.delta_tokens)


@attrs.frozen(kw_only=True)
class Traffic:
    """Run totals of the engine and the expert cache over one point."""

    expert_bytes_fetched: int  # bytes moved over the link
    hit_bytes: int
    miss_bytes: int
    exposed_fetch_s: float  # time forwards waited for experts
    model_s: float  # time in model forwards (waits included)
    # wall time with a forward or an expert copy running, each instant counted once (the engine's
    # EngineStats.busy_s); a simulated run gives its forwards' time (model_s)
    busy_s: float = attrs.field(default=attrs.Factory(lambda self: self.model_s, takes_self=True))
    link_busy_s: float = 0.0  # time the link carried fetches (the cache's link_busy_s)


@attrs.frozen(kw_only=True)
class PointResult:
    config: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ms_per_token: float  # wall / tokens, ms (per-request latency per token at concurrency 1)
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tau: float  # mean tokens per verify round, bonus included
    bytes_per_token: float  # expert bytes fetched per output token
    hit_rate: float  # bytes
    projection_coverage_bytes: float | None
    exposed_fetch_share: float  # exposed fetch time / wall
    admission_wait_p50_ms: float  # per request: its mean wait per round
    admission_wait_p99_ms: float
    fairness: float  # Jain's index over per-request token rates
    engine_overhead: float  # share of wall with neither a forward nor an expert copy running: 1 - busy / wall
    # share of wall the link carried fetches; 1 - this - engine_overhead: forwards ran while the link idled
    link_busy_share: float = math.nan  # (nan: a report written before it was measured)
    extra: dict = attrs.field(factory=dict)  # run-specific notes (time scale, budgets, source)

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index (Σx)² / (n Σx²): 1 when all equal, 1/n when one takes all."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else math.nan


def inter_token_gaps_s(record: RequestRecord) -> list[float]:
    """One sample per token after the first delta: the delta's gap shared by the tokens it carries."""
    gaps = []
    for i in range(1, len(record.delta_times_s)):
        n = record.delta_tokens[i]
        if n:
            gaps += [(record.delta_times_s[i] - record.delta_times_s[i - 1]) / n] * n
    return gaps


def summarise(
    config: str, concurrency: int, records: Sequence[RequestRecord], traffic: Traffic, wall_s: float, **extra
) -> PointResult:
    tokens = sum(r.tokens for r in records)
    rounds = [a for r in records for a in r.acceptance_lengths]
    gaps = [g for r in records for g in inter_token_gaps_s(r)]
    ttfts = [r.first_token_s - r.arrived_s for r in records]
    waits = [r.admission_wait_s / len(r.acceptance_lengths) for r in records if r.acceptance_lengths]
    rates = [r.tokens / (r.finished_s - r.arrived_s) for r in records if r.finished_s > r.arrived_s]
    coverages = [r.projection_coverage_bytes for r in records if r.projection_coverage_bytes is not None]
    needed = traffic.hit_bytes + traffic.miss_bytes
    return PointResult(
        config=config,
        concurrency=concurrency,
        requests=len(records),
        tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s else math.nan,
        ms_per_token=1e3 * wall_s / tokens if tokens else math.nan,
        ttft_p50_ms=1e3 * percentile(ttfts, 0.5),
        ttft_p99_ms=1e3 * percentile(ttfts, 0.99),
        itl_p50_ms=1e3 * percentile(gaps, 0.5),
        itl_p99_ms=1e3 * percentile(gaps, 0.99),
        tau=sum(rounds) / len(rounds) if rounds else math.nan,
        bytes_per_token=traffic.expert_bytes_fetched / tokens if tokens else math.nan,
        hit_rate=traffic.hit_bytes / needed if needed else math.nan,
        projection_coverage_bytes=sum(coverages) / len(coverages) if coverages else None,
        exposed_fetch_share=traffic.exposed_fetch_s / wall_s if wall_s else math.nan,
        admission_wait_p50_ms=1e3 * percentile(waits, 0.5),
        admission_wait_p99_ms=1e3 * percentile(waits, 0.99),
        fairness=jain(rates),
        engine_overhead=max(0.0, 1 - traffic.busy_s / wall_s) if wall_s else math.nan,  # busy may end just after wall
        link_busy_share=traffic.link_busy_s / wall_s if wall_s else math.nan,
        extra=dict(extra),
    )
