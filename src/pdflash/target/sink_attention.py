"""Grouped-query attention with learned per-head sinks and an optional sliding window (gpt-oss).

A sink is one extra logit per head that joins the softmax and is then dropped: it takes
probability mass from every key without contributing a value. A sliding window of W lets a
query see the W most recent keys, itself included.
"""

from __future__ import annotations

import torch


def visible_keys(past: int, n: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[n, past+n] bool: query i (at position past+i) sees key j; None when every key is visible."""
    if n == 1 and (window is None or past < window):
        return None
    query = torch.arange(past, past + n, device=device)[:, None]  # [n, 1]
    key = torch.arange(past + n, device=device)[None, :]  # [1, S]
    visible = key <= query
    if window is not None:
        visible &= key > query - window
    return visible


def attend_with_sinks(
    q: torch.Tensor,  # [heads, T, D]
    k: torch.Tensor,  # [kv, S, D]
    v: torch.Tensor,  # [kv, S, D]
    visible: torch.Tensor | None,  # [T, S] bool, None = every key
    sinks: torch.Tensor,  # [heads] sink logits
) -> torch.Tensor:
    """[heads, T, D]; query head h reads kv head h // (heads / kv)."""
    heads, T, D = q.shape
    kv = k.shape[0]
    group = heads // kv
    scores = torch.bmm(q.reshape(kv, group * T, D), k.transpose(1, 2)).float() * D**-0.5  # [kv, group*T, S]
    if visible is not None:
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    sink = sinks.float().view(kv, group, 1, 1).expand(kv, group, T, 1).reshape(kv, group * T, 1)
    logits = torch.cat([scores, sink], dim=-1)  # [kv, group*T, S+1]
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]  # sink dropped
    return torch.bmm(probs.to(v.dtype), v).view(heads, T, D)
