"""Routing of tokens to experts: top-k selection and the token→expert permutation.

Owns the `Routing` value object that the MoE layer, the byte projection and the prefetcher
consume. Plain torch; the Triton variant lives in `pdflash.kernels.triton_routing`.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True)
class Routing:
    """Where each token of a batch goes, and the permutation that groups tokens by expert."""

    topk_ids: torch.Tensor  # [T, K] int64 expert id of each (token, slot) assignment
    topk_weights: torch.Tensor  # [T, K] routing weight of each assignment (float32)
    sorted_assignments: torch.Tensor  # [T*K] int64 flat assignment index t*K+k, grouped by expert
    expert_offsets: torch.Tensor  # [E+1] int64; expert e owns sorted_assignments[off[e]:off[e+1]]

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def union_mask(self) -> torch.Tensor:
        """[E] bool: experts routed by at least one token."""
        return self.expert_offsets[1:] > self.expert_offsets[:-1]

    def union_ids(self) -> torch.Tensor:
        """[U] int64 ascending ids of the routed experts."""
        return self.union_mask.nonzero().flatten()


def route_reference(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Softmax (float32) over experts, top-k, optional renormalisation of the k weights."""
    num_tokens, num_experts = router_logits.shape  # [T, E]
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return permutation(topk_ids, topk_weights, num_experts)


def permutation(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Routing:
    """Group the T*K assignments by expert (stable within an expert: token order kept)."""
    flat_ids = topk_ids.flatten()  # [T*K]
    sorted_assignments = torch.sort(flat_ids, stable=True).indices  # [T*K]
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    expert_offsets[1:] = torch.cumsum(counts, dim=0)
    return Routing(
        topk_ids=topk_ids,
        topk_weights=topk_weights.float(),
        sorted_assignments=sorted_assignments,
        expert_offsets=expert_offsets,
    )
