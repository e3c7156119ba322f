"""Offline demand paging of expert-cache accesses: what eviction could still save.

Owns the access record (`Access`: one forward's routed experts at one MoE layer), a recorder
that writes down every request a running cache serves while its own policy decides
(`RecordingPolicy`), and `replay`: the misses of paging a list of accesses on a number of
slots under the real policies of pdflash.offload.eviction, a `next-launch` oracle and
Belady's OPT. A forward pins its own layer's union; prefetches are left out, so a replay
counts bytes, not time. Must not touch engines, traces or reports
(`benchmarks/bench_eviction_ceiling.py` runs them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdflash.offload.eviction import EvictionPolicy, make_policy
from pdflash.target.experts import ExpertKey

Access = tuple[int, tuple[int, ...]]  # (MoE layer, experts one forward routes at that layer)
REPLAYED = ("lru", "activation", "next-launch", "opt")


class RecordingPolicy:
    """A cache's own eviction policy, unchanged, that also writes down every forward's request."""

    def __init__(self, inner: EvictionPolicy, trace: list[Access]) -> None:
        self.inner, self.trace, self.name = inner, trace, inner.name

    def observe(self, layer: int, union: Iterable[int]) -> None:
        union = tuple(union)
        self.trace.append((layer, union))
        self.inner.observe(layer, union)

    def forget(self, key: ExpertKey) -> None:
        self.inner.forget(key)

    def score(self, key: ExpertKey) -> tuple:
        return self.inner.score(key)


def replay(trace: Sequence[Access], slots: int, policy: str, layers: int) -> int:
    """Misses of demand paging `trace` on `slots` slots under `policy` (one of REPLAYED).

    "lru" and "activation" are the cache's own policies; "next-launch" is activation with the
    experts of the next `layers` accesses (the next batched forward) evicted last; "opt" evicts
    the expert used again furthest ahead (never again: first). A miss with every slot pinned
    by its own forward streams through without staying.
    """
    if policy not in REPLAYED:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(REPLAYED)}")
    online = make_policy("lru" if policy == "lru" else "activation") if policy != "opt" else None
    uses: dict[ExpertKey, list[int]] = {}  # key -> indices of the accesses that route it
    for i, (layer, union) in enumerate(trace):
        for expert in union:
            uses.setdefault((layer, expert), []).append(i)
    seen = dict.fromkeys(uses, 0)  # key -> its uses so far
    cache: set[ExpertKey] = set()
    misses = 0
    for i, (layer, union) in enumerate(trace):
        keys = [(layer, expert) for expert in union]
        if online is not None:
            online.observe(layer, union)
        for key in keys:
            seen[key] += 1
        victim_key = _victim_rule(policy, online, uses, seen, trace[i + 1 : i + 1 + layers], never=len(trace))
        for key in keys:
            if key in cache:
                continue
            misses += 1
            if len(cache) >= slots:
                candidates = [c for c in cache if c[0] != layer or c[1] not in union]  # this forward pins its own
                if not candidates:
                    continue
                victim = min(candidates, key=victim_key)
                cache.discard(victim)
                if online is not None:
                    online.forget(victim)
            cache.add(key)
    return misses


def _victim_rule(
    policy: str,
    online: EvictionPolicy | None,
    uses: dict[ExpertKey, list[int]],
    seen: dict[ExpertKey, int],
    ahead: Sequence[Access],
    *,
    never: int,  # an access index past the last: "not used again"
) -> Callable[[ExpertKey], tuple]:
    """The key whose smallest value is evicted first, at the current access."""
    if policy == "opt":
        return lambda key: (-(uses[key][seen[key]] if seen[key] < len(uses[key]) else never),)
    assert online is not None
    if policy == "next-launch":
        soon = {(layer, expert) for layer, union in ahead for expert in union}
        return lambda key: (key in soon, *online.score(key))
    return online.score
