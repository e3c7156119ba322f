"""Triton routing: fused float32 softmax + top-k over router logits, then the expert permutation.

One program handles a block of tokens with all E logits in registers; the k winners are taken
by k rounds of argmax on the logits (softmax is monotonic, so this picks the same experts as
top-k on the probabilities, in the same descending order). The permutation grouped by expert
reuses the torch `permutation` (a stable sort and a bincount) on the kernel's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdflash.kernels.routing import Routing, permutation

_TILE_ELEMENTS = 4096  # logits held by one program: BLOCK_T * BLOCK_E


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    num_tokens,
    num_experts,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    safe_rows = tl.minimum(rows, num_tokens - 1)  # padding rows repeat the last token, never stored
    cols = tl.arange(0, BLOCK_E)
    logits = tl.load(
        logits_ptr + safe_rows[:, None] * num_experts + cols[None, :],
        mask=cols[None, :] < num_experts,
        other=float("-inf"),
    ).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]  # [BLOCK_T, BLOCK_E]

    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(logits, axis=1)  # [BLOCK_T]
        hit = cols[None, :] == best[:, None]  # [BLOCK_T, BLOCK_E]
        weight = tl.sum(tl.where(hit, probs, 0.0), axis=1)  # [BLOCK_T]
        logits = tl.where(hit, float("-inf"), logits)
        ids = tl.where(ks[None, :] == k, best[:, None].to(tl.int64), ids)
        weights = tl.where(ks[None, :] == k, weight[:, None], weights)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = rows[:, None] * TOP_K + ks[None, :]
    out_mask = row_mask[:, None] & (ks[None, :] < TOP_K)
    tl.store(ids_ptr + out, ids, mask=out_mask)
    tl.store(weights_ptr + out, weights, mask=out_mask)


def route_triton(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Same contract as `route_reference`: softmax (float32), top-k, optional renormalisation."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E]; got shape {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..E={num_experts}; got {top_k}")
    logits = router_logits.contiguous()  # [T, E]
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)  # [T, K]
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens > 0:
        block_e = triton.next_power_of_2(num_experts)
        block_t = min(max(1, _TILE_ELEMENTS // block_e), triton.next_power_of_2(num_tokens))
        _softmax_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
            logits,
            topk_ids,
            topk_weights,
            num_tokens,
            num_experts,
            TOP_K=top_k,
            NORMALIZE=normalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k),
        )
    return permutation(topk_ids, topk_weights, num_experts)
