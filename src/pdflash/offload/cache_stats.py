"""The device cache's counters and the snapshot of them its stats report.

Owns what is counted (fetches, hits and misses by bytes, evictions, exposed fetch and link-busy time,
prefetch coverage and waste) and how a snapshot is derived from the counts. The cache
updates the counters under its own lock; this module knows nothing of slots or threads.
"""

from __future__ import annotations

import attrs


@attrs.define
class Counters:
    fetches: int = 0
    expert_bytes_fetched: int = 0
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    evictions: int = 0
    peak_slots: int = 0
    exposed_fetch_s: float = 0.0
    link_busy_s: float = 0.0
    prefetch_requests: int = 0
    prefetch_fetches: int = 0
    prefetch_bytes: int = 0
    prefetch_dropped: int = 0
    prefetch_hits: int = 0
    prefetch_hit_bytes: int = 0
    prefetch_waste_bytes: int = 0
    fetch_errors: int = 0


@attrs.frozen(kw_only=True)
class OffloadStats:
    """A snapshot of the cache's counters since construction or the last `reset_stats()`."""

    link: str  # "none" | "device" | "emulated"
    link_bytes_per_s: float | None  # the rate copies are priced at: emulated, or measured at start; None: no link
    policy: str  # eviction policy name
    expert_cache_bytes: int  # budget (device bytes, compute dtype)
    expert_cache_slots: int  # experts the arena holds
    expert_slot_bytes: int  # device bytes of one expert in the compute dtype
    expert_cache_peak_bytes: int  # most slots ever occupied (reserved or ready) x slot bytes
    expert_bytes_fetched: int  # byte-map bytes copied by successful fetches (on demand + prefetch)
    fetches: int  # successful fetches
    hits: int  # routed experts a forward found resident or in flight
    misses: int  # routed experts a forward had to fetch itself
    hit_bytes: int
    miss_bytes: int
    expert_cache_hit_rate: float  # hit_bytes / (hit_bytes + miss_bytes), 0.0 before any need
    evictions: int
    exposed_fetch_s: float  # time forwards spent waiting for the lane (or for a free slot)
    link_busy_s: float  # time the lane spent carrying fetches (emulated link: the pipe's time; CUDA: issuing copies)
    prefetch_requests: int  # prefetch keys queued (not resident when asked)
    prefetch_fetches: int  # of those, fetched
    prefetch_bytes: int  # byte-map bytes fetched by prefetches
    prefetch_dropped: int  # wanted keys whose claims all ended before a slot could be freed for them
    claimed_experts: int  # experts some unreleased prefetch claim keeps
    prefetch_coverage: float  # bytes: first uses of prefetched experts / (those + misses)
    prefetch_waste_bytes: int  # prefetched bytes evicted before any forward used them
    fetch_errors: int

    @classmethod
    def of(
        cls,
        c: Counters,
        *,
        link: str,
        link_bytes_per_s: float | None,
        policy: str,
        budget_bytes: int,
        num_slots: int,
        slot_bytes: int,
        claimed_experts: int,
    ) -> OffloadStats:
        """The snapshot of counters `c` of a cache with this link, policy and arena."""
        counted = attrs.fields_dict(Counters).keys() & attrs.fields_dict(cls).keys()
        return cls(
            **{name: getattr(c, name) for name in counted},  # the counts go across by name
            link=link,
            link_bytes_per_s=link_bytes_per_s,
            policy=policy,
            expert_cache_bytes=budget_bytes,
            expert_cache_slots=num_slots,
            expert_slot_bytes=slot_bytes,
            expert_cache_peak_bytes=c.peak_slots * slot_bytes,
            expert_cache_hit_rate=ratio(c.hit_bytes, c.hit_bytes + c.miss_bytes),
            claimed_experts=claimed_experts,
            prefetch_coverage=ratio(c.prefetch_hit_bytes, c.prefetch_hit_bytes + c.miss_bytes),
        )

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
