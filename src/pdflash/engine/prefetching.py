"""What a launch prefetches: the experts its verifies are likely enough to route, each claimed by one of them.

Owns the certainty rule. Behind a link, a prefetched expert that no verify routes costs its
bytes and evicts one a later round would have hit, while a prefetched expert that is routed
saves only the wait an on-demand fetch would have added inside the forward. So a launch
prefetches an expert of its verifies' projected unions only when the chance that at least one
of them routes it, 1 − Π_v (1 − p_v), reaches PREFETCH_CERTAINTY, where p_v is the
projector's probability for verify v (pdflash.spec.projection.Projection). The prefetch never
leaves the projected unions: those stay what a verify is charged and priced by, and what it
prefetches is a part of them. Pure: the pacer and the simulator hand it the projections of the
verifies one tick admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdflash.spec.projection import Projection
from pdflash.target.experts import ExpertKey

# Measured on the bundled pair behind the emulated link (docs/engine.md, "What a launch
# prefetches"): at 0.7 plain decoding fetched 17-25% fewer bytes per token than prefetching
# every projected expert at concurrency 1 and 4, and 3-5% more at 16 and 32; 0.5 saved less.
PREFETCH_CERTAINTY = 0.7


def launch_prefetches(
    projections: Sequence[Projection], certainty: float = PREFETCH_CERTAINTY
) -> list[frozenset[ExpertKey]]:
    """Per verify, in the order given, the experts its prefetch claims: every expert of their
    projected unions that they route with probability >= `certainty` (1 − Π (1 − p) over all
    of them, scored outside a union too), claimed by the verify most likely to route it (the
    first of equals). A projection without probabilities counts each member of its union as
    certain."""
    if not 0.0 < certainty <= 1.0:
        raise ValueError(f"prefetch certainty must be in (0, 1], got {certainty}")
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
