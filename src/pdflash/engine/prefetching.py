"""What a launch prefetches: the experts its verifies are likely enough to route, each claimed by one of them.

Owns the certainty rule. A launch's copies take F seconds of link (the bytes its projected
unions add to what is resident, over the link rate) and its verify C seconds of compute.
Prefetching an expert (copy time t) that no verify routes wastes t of link, which costs the
wall about t·F/(F + C), the share of the time the link binds; not prefetching one that is
routed stalls the forward for its on-demand copy, about t·C/(F + C). So an expert routed with
probability p is worth prefetching when p·C ≥ (1 − p)·F, that is p ≥ F/(F + C)
(`launch_certainty`): link-bound, a launch prefetches only what is nearly sure; with a fast
link, all it projected. p is the chance that at least one of the launch's verifies routes it,
1 − Π_v (1 − p_v), from the projector's probabilities (pdflash.spec.projection.Projection).
The prefetch never leaves the projected unions: those stay what a verify is charged and
priced by, and what it prefetches is a part of them. Pure: the pacer and the simulator hand
it the projections of the verifies one tick admitted, and the seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdflash.spec.projection import Projection
from pdflash.target.experts import ExpertKey


def launch_certainty(fetch_bytes: int, link_bytes_per_s: float | None, compute_s: float | None) -> float:
    """The probability from which a launch prefetches an expert: its copies' share of its
    time, F / (F + C). 0 (every projected expert) with copies that take no time, or before
    any verify was timed."""
    if link_bytes_per_s is None or compute_s is None or fetch_bytes <= 0:
        return 0.0
    fetch_s = fetch_bytes / link_bytes_per_s
    return fetch_s / (fetch_s + max(0.0, compute_s))


def launch_prefetches(projections: Sequence[Projection], certainty: float) -> list[frozenset[ExpertKey]]:
    """Per verify, in the order given, the experts its prefetch claims: every expert of their
    projected unions that they route with probability >= `certainty` (1 − Π (1 − p) over all
    of them, scored outside a union too), claimed by the verify most likely to route it (the
    first of equals). A projection without probabilities counts each member of its union as
    certain."""
    if not 0.0 <= certainty <= 1.0:
        raise ValueError(f"prefetch certainty must be in [0, 1], got {certainty}")
    missed: dict[ExpertKey, float] = {}  # expert -> P(no verify routes it)
    owner: dict[ExpertKey, tuple[int, float]] = {}  # expert -> (verify most likely to route it, its p)
    for i, projection in enumerate(projections):
        chances = projection.probability if projection.probability is not None else dict.fromkeys(projection.union, 1.0)
        for expert, p in chances.items():
            missed[expert] = missed.get(expert, 1.0) * (1.0 - p)
            if expert not in owner or p > owner[expert][1]:
                owner[expert] = (i, p)
    projected = frozenset().union(*(projection.union for projection in projections))
    claims: list[set[ExpertKey]] = [set() for _ in projections]
    for expert, (i, _) in owner.items():
        if expert in projected and 1.0 - missed[expert] >= certainty:
            claims[i].add(expert)
    return [frozenset(claim) for claim in claims]
