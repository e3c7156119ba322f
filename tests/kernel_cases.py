"""Inputs of the expert-kernel tests, shared by the CPU (interpreted) and the CUDA (compiled) runs.

Everything is built on the CPU from the caller's seed, so both runs draw the same cases; CUDA
tests move them with `to_device`. Nothing here imports triton.
"""

from __future__ import annotations

import attrs
import torch

from pdflash.kernels.mxfp4 import pack_mxfp4
from pdflash.kernels.routing import Routing, permutation

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: 1e-4 absolute; half types: max error within 1e-2 of the reference's max |value|."""
    err = (got - want).abs().max().item()
    bound = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    assert err <= bound, f"max error {err} > {bound} ({dtype})"


def distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, E] logits with no ties in a row, exact in bfloat16 (multiples of 1/32 up to 8)."""
    ranks = torch.argsort(torch.rand(num_tokens, num_experts), dim=1)  # [T, E]
    return ((ranks.float() - num_experts / 2) / 32).to(dtype)


def ragged_routing(num_tokens: int, num_experts: int, top_k: int) -> Routing:
    """Expert 0 takes every token (several tiles, ragged), expert 1 one token, the last two
    experts none; the other picks are random."""
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for t in range(num_tokens):
        rest = torch.randperm(num_experts - 4)[: top_k - 1] + 2  # from 2..E-3
        ids[t] = torch.cat([torch.tensor([0]), rest])
    ids[num_tokens // 2, 1] = 1
    weights = torch.rand(num_tokens, top_k)
    return permutation(ids, weights, num_experts)


def slots_for(num_experts: int, skipped: list[int]) -> tuple[torch.Tensor, int]:
    """[E] slot map: experts in `skipped` get -1, the rest distinct shuffled slots."""
    slot_of_expert = torch.full((num_experts,), -1, dtype=torch.int64)
    kept = [e for e in range(num_experts) if e not in skipped]
    slot_of_expert[kept] = torch.randperm(len(kept))
    return slot_of_expert, len(kept)


def expert_weights(slots: int, hidden: int, inter: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Random dense experts drawn on `device` (its own generator: real expert sizes draw fast on a GPU)."""
    gate = torch.randn(slots, inter, hidden, device=device) / hidden**0.5  # [S, I, H]
    up = torch.randn(slots, inter, hidden, device=device) / hidden**0.5  # [S, I, H]
    down = torch.randn(slots, hidden, inter, device=device) / inter**0.5  # [S, H, I]
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def mxfp4_experts(slots: int, hidden: int, inter: int, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    gate, up, down = expert_weights(slots, hidden, inter, torch.float32, device)
    return [*pack_mxfp4(gate), *pack_mxfp4(up), *pack_mxfp4(down)]


def to_device(routing: Routing, device: torch.device) -> Routing:
    """The same routing with every tensor on `device`."""
    return Routing(**{field.name: getattr(routing, field.name).to(device) for field in attrs.fields(Routing)})
