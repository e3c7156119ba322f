"""`pdflash simulate --replicas N`: N independent engine replicas sharing c closed-loop clients.

Owns the projection for Ray Serve replicas (docs/ray.md): replicas share nothing (each has its
own device, expert cache and host link), so c clients spread evenly over N replicas are N
engines at c/N clients each, and the aggregate is their sum. Must not simulate an engine
itself: the caller simulates one replica per distinct load and this module combines them.
What it does not model: a host link or host memory shared by replicas on one machine, and the
router's imbalance (Ray's power of two choices keeps loads near even; the split here is even).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import attrs

from pdflash.bench.metrics import PointResult


def replica_loads(concurrency: int, replicas: int) -> list[int]:
    """Clients per replica, as even as integers allow (a replica with no client is left out)."""
    if replicas < 1:
        raise ValueError(f"--replicas={replicas} is invalid: it must be >= 1")
    base, extra = divmod(concurrency, replicas)
    return [base + 1 if i < extra else base for i in range(replicas) if base + (i < extra) > 0]


def replicated_point(concurrency: int, replicas: int, simulate: Callable[[int], PointResult]) -> PointResult:
    """The aggregate of `replicas` engines serving `concurrency` clients; `simulate(load)` runs one engine.

    Sums: requests, tokens, tokens/s. Token-weighted means: ms per token, tau, bytes per token,
    hit rate, coverage, exposed fetch share, overhead. Latency percentiles and fairness: the
    worst replica's (exact when every replica has the same load, conservative otherwise).
    """
    loads = Counter(replica_loads(concurrency, replicas))
    one = {load: simulate(load) for load in loads}
    parts = [(one[load], count) for load, count in loads.items()]
    tokens = sum(p.tokens * n for p, n in parts)

    def mean(key: str) -> float:
        return sum(getattr(p, key) * p.tokens * n for p, n in parts) / tokens if tokens else 0.0

    def worst(key: str, pick: Callable = max) -> float:
        return pick(getattr(p, key) for p, _ in parts)

    coverage = [p.projection_coverage_bytes for p, _ in parts]
    first = parts[0][0]
    return attrs.evolve(
        first,
        concurrency=concurrency,
        requests=sum(p.requests * n for p, n in parts),
        tokens=tokens,
        wall_s=worst("wall_s"),
        tokens_per_s=sum(p.tokens_per_s * n for p, n in parts),
        ms_per_token=mean("ms_per_token"),
        ttft_p50_ms=worst("ttft_p50_ms"),
        ttft_p99_ms=worst("ttft_p99_ms"),
        itl_p50_ms=worst("itl_p50_ms"),
        itl_p99_ms=worst("itl_p99_ms"),
        tau=mean("tau"),
        bytes_per_token=mean("bytes_per_token"),
        hit_rate=mean("hit_rate"),
        projection_coverage_bytes=None if None in coverage else mean("projection_coverage_bytes"),
        exposed_fetch_share=mean("exposed_fetch_share"),
        admission_wait_p50_ms=worst("admission_wait_p50_ms"),
        admission_wait_p99_ms=worst("admission_wait_p99_ms"),
        fairness=worst("fairness", min),
        engine_overhead=mean("engine_overhead"),
        link_busy_share=mean("link_busy_share"),
        extra=first.extra | {"replicas": replicas, "replica_loads": sorted(loads.elements(), reverse=True)},
    )
