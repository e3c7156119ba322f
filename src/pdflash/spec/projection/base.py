"""What every route projector shares: routed unions, exact byte sums, the projection and its quality record, the protocol.

A projector names the (layer, expert) pairs a drafted block's verify will route to, one
union per session, and, where it scores experts, how likely each one is. Byte figures are
exact sums over the byte map, never count × average.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from pdflash.target.experts import ExpertKey


def routed_union(routed: torch.Tensor, moe_layer_ids: Sequence[int]) -> frozenset[ExpertKey]:
    """[n, L_moe, K] routed ids → the set of (layer, expert) pairs they touch."""
    # A set over a Python list: `Tensor.unique(dim=0)` costs ~0.7 ms here, a sizeable share of a verify.
    return frozenset(
        (layer, expert)
        for token in routed.tolist()
        for layer, experts in zip(moe_layer_ids, token, strict=True)
        for expert in experts
    )


def union_bytes(union: Iterable[ExpertKey], expert_nbytes: Mapping[ExpertKey, int]) -> int:
    return sum(expert_nbytes[key] for key in union)


PROBABILITY_FLOOR = 0.02  # a projection's probabilities stop below this: too unlikely to prefetch for any launch


@attrs.frozen
class Projection:
    """One block's projected route: the union its verify is charged for, and the projector's
    confidence in each expert (the prefetch of a launch reads it: pdflash.engine.prefetching)."""

    union: frozenset[ExpertKey]  # projected (layer, expert) pairs
    # P(the verify routes it) of every expert scored at PROBABILITY_FLOOR or more, members of
    # `union` or not; None: the projector does not score, and takes its union's members as certain
    probability: Mapping[ExpertKey, float] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class ProjectionQuality:
    """How a projected union compared with the union the verify actually routed."""

    coverage: float  # |projected ∩ actual| / |actual|
    coverage_bytes: float  # bytes(projected ∩ actual) / bytes(actual)
    waste_bytes: int  # bytes(projected − actual): fetched for nothing

    @classmethod
    def compare(cls, projected, actual, expert_nbytes) -> ProjectionQuality:
        hit = projected & actual
        actual_bytes = union_bytes(actual, expert_nbytes)
        return cls(
            coverage=len(hit) / len(actual) if actual else 1.0,
            coverage_bytes=union_bytes(hit, expert_nbytes) / actual_bytes if actual_bytes else 1.0,
            waste_bytes=union_bytes(projected - actual, expert_nbytes),
        )


class Projector(Protocol):
    """`project` gets the speculator, the sessions and their drafted blocks (each [n_i] int64:
    the anchor, then n_i − 1 drafts; n_i = 1 is the anchor alone) and returns one projection each."""

    name: str
    # True: it never runs the target, so a block's anchor alone can be projected the moment a
    # verify has chosen it, before the drafter runs (the engine prefetches its experts then)
    target_free: bool

    def project(self, speculator: Any, sessions: Sequence[Any], blocks: Sequence[torch.Tensor]) -> list[Projection]: ...
