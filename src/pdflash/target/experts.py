"""The expert-provider seam: where a MoE layer gets the weights of the experts it routed to.

The model asks a provider for the routed union of one layer and computes wave by wave; a
provider decides where weights live (all resident here; the offloaded store and device
cache implement the same protocol). Experts of a wave stay pinned until the consumer
advances to the next wave or closes the iterator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs
import torch

ExpertKey = tuple[int, int]  # (MoE layer index, expert index): the one name for an expert everywhere


@attrs.frozen(kw_only=True)
class ExpertWave:
    """Weights of some routed experts of one layer, arranged in slots."""

    slot_of_expert: torch.Tensor  # [E] int64: slot holding expert e in this wave, -1 if absent
    gate: torch.Tensor  # [S, I, H]
    up: torch.Tensor  # [S, I, H]
    down: torch.Tensor  # [S, H, I]


class ExpertProvider(Protocol):
    def waves(self, layer: int, union: list[int]) -> Iterator[ExpertWave]:
        """Waves that together cover every expert id in `union` of MoE layer `layer`."""
        ...


class ResidentExperts:
    """Every expert of every MoE layer held in memory as stacked tensors: one wave per layer."""

    def __init__(self, stacks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.stacks = stacks  # layer -> (gate [E, I, H], up [E, I, H], down [E, H, I])
        num_experts = next(iter(stacks.values()))[0].shape[0] if stacks else 0
        self._identity = torch.arange(num_experts)

    def waves(self, layer: int, union: list[int]) -> Iterator[ExpertWave]:
        gate, up, down = self.stacks[layer]
        yield ExpertWave(slot_of_expert=self._identity.to(gate.device), gate=gate, up=up, down=down)
