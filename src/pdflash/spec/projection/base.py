"""What every route projector shares: routed unions, exact byte sums, the quality record, the protocol.

A projector names the (layer, expert) pairs a drafted block's verify will route to, one
union per session. Byte figures are exact sums over the byte map, never count × average.
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
    the anchor, then n_i − 1 drafts; n_i = 1 is the anchor alone) and returns one union each."""

    name: str

    def project(
        self, speculator: Any, sessions: Sequence[Any], blocks: Sequence[torch.Tensor]
    ) -> list[frozenset[ExpertKey]]: ...
