"""Grouped-query attention of a block of new queries over cached keys, shared by target and drafter.

On the CPU, `scaled_dot_product_attention` with grouped heads takes its math fallback, which
costs about three times two batched matmuls at decode sizes (measured on the 2-core CPU: 127 vs
40 µs for 8 queries over 300 keys, 70 vs 22 µs for one query). So short blocks on the CPU fold
each kv head's query heads into its rows and run the two matmuls directly. Long blocks
(prefill) and accelerators keep SDPA, which never materialises the [heads, T, keys] scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHORT_BLOCK = 64  # queries per sequence up to which the CPU path materialises the scores


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """q [heads, T, D], k and v [kv, S, D], visible [T, S] bool (None: every key) -> [heads, T, D].

    Query head h reads kv head h // (heads / kv), as in Qwen3 and `enable_gqa`.
    """
    heads, T, D = q.shape
    kv = k.shape[0]
    if q.device.type != "cpu" or T > SHORT_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    group = heads // kv
    scores = torch.bmm(q.reshape(kv, group * T, D) * D**-0.5, k.transpose(1, 2))  # [kv, group*T, S]
    if visible is not None:
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    return torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v).view(heads, T, D)
