"""Route projection: which (layer, expert) pairs a drafted block's verify will route to.

Projectors are pluggable; each returns one projected union per session. The byte figures
are exact sums over the byte map, never count × average.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

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


def union_bytes(union: Iterable[ExpertKey], expert_nbytes: dict[ExpertKey, int]) -> int:
    return sum(expert_nbytes[key] for key in union)


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
    name: str

    def project(self, speculator, sessions, blocks: Sequence[torch.Tensor]) -> list[frozenset[ExpertKey]]: ...


class LastUnionProjector:
    """Assume the block routes like the session's previous target forward did."""

    name = "last-union"

    def project(self, speculator, sessions, blocks):
        return [s.last_union for s in sessions]


class RouterPassProjector:
    """A router-only pass of the drafted blocks through the target: attention and gates, experts skipped."""

    name = "router"

    def project(self, speculator, sessions, blocks):
        target = speculator.target
        out = target.forward(blocks, [s.target_cache for s in sessions], skip_experts=True, commit=False)
        return [routed_union(r, target.config.moe_layer_ids) for r in out.split(out.routed)]


class ExactProjector:
    """The true union: a full uncommitted forward of the block (as costly as the verify; an upper bound)."""

    name = "exact"

    def project(self, speculator, sessions, blocks):
        target = speculator.target
        out = target.forward(blocks, [s.target_cache for s in sessions], commit=False)
        return [routed_union(r, target.config.moe_layer_ids) for r in out.split(out.routed)]


PROJECTORS: dict[str, Callable[[], Projector]] = {
    p.name: p for p in (LastUnionProjector, RouterPassProjector, ExactProjector)
}


def make_projector(name: str) -> Projector:
    if name not in PROJECTORS:
        raise ValueError(f"projector {name!r} is unknown; choose one of {', '.join(PROJECTORS)}")
    return PROJECTORS[name]()
