"""Static-shape step functions of the Qwen3-MoE target over a padded batch (what `compiled.py` compiles).

A step runs n new tokens for each of B padded sequences: shapes depend only on (B, n) and the
key length S of the gathered past, never on the data. Attention reads the past K/V [B, kv, S, D]
plus the new block under a `visible` mask (a past key is visible below the sequence's length,
a new key causally), so padded rows and stale cache rows never reach a real token. Experts are
computed from a wave's slot weights gathered per assignment into fused reductions: T*K expert
slices read, each distinct one from memory once (the rest from cache), where a dense matmul
over every slot would read all E experts; on the CPU the step is memory-bound, so this is the
faster form at every bucket measured (docs/compile.md). A slot map of -1 skips an expert, so
offloaded waves run unchanged.

Linear weights come transposed, [in, out] (`transposed` in compiled.py): on the CPU a
row-major [in, out] weight is stored contiguous, which MKL's small-M GEMM streams about twice
as fast from memory as the usual [out, in] (measured cold, docs/compile.md).

Pure tensor functions with shape comments; no caches, providers or Python loops over tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdflash.target.model import rms_norm


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight_t [in, out] (+ bias [out]): a linear layer over a transposed weight."""
    y = x @ weight_t
    return y if bias is None else y + bias


def step_inputs(
    ids: torch.Tensor,  # [B, n] int64 new tokens (padding anywhere past a sequence's count)
    lengths: torch.Tensor,  # [B] int64 cached tokens per sequence (0 for a padded row)
    past_keys: torch.Tensor,  # [..., S, D] the padded past: only its length S is read
    embed: torch.Tensor,  # [V, H]
    inv_freq: torch.Tensor,  # [D/2] float32
    rope_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings [B, n, H], cos and sin [B, n, D], and the visible mask [B, n, S+n] bool."""
    B, n = ids.shape
    positions = lengths[:, None] + torch.arange(n, device=ids.device)  # [B, n]
    freqs = positions.float()[..., None] * inv_freq  # [B, n, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, n, D]
    cos, sin = ((emb.cos() * rope_scale).to(embed.dtype), (emb.sin() * rope_scale).to(embed.dtype))
    past = torch.arange(past_keys.shape[-2], device=ids.device) < lengths[:, None]  # [B, S]
    new = torch.ones((n, n), dtype=torch.bool, device=ids.device).tril()  # [n, n]
    visible = torch.cat([past[:, None, :].expand(B, n, -1), new.expand(B, n, n)], dim=-1)  # [B, n, S+n]
    return F.embedding(ids, embed), cos, sin, visible


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, heads, n, D] by cos, sin [B, n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def masked_attention(
    q: torch.Tensor,  # [B, heads, n, D]
    past: tuple[torch.Tensor, torch.Tensor],  # keys and values [B, kv, S, D] of the padded past
    new: tuple[torch.Tensor, torch.Tensor],  # keys and values [B, kv, n', D] of the block (or context + block)
    visible: torch.Tensor,  # [B, n, S+n'] bool
) -> torch.Tensor:
    """Grouped-query attention -> [B, n, heads*D]; query head h reads kv head h // (heads / kv).

    Past and new keys are scored apart and share one softmax, so the past is never copied.
    """
    B, heads, n, D = q.shape
    kv, S = past[0].shape[1], past[0].shape[2]
    group = heads // kv
    q = q.reshape(B, kv, group * n, D) * D**-0.5
    scores = torch.cat([q @ past[0].transpose(-1, -2), q @ new[0].transpose(-1, -2)], dim=-1)  # [B, kv, g*n, S+n']
    scores = scores.masked_fill(~visible.repeat(1, group, 1)[:, None], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    out = probs[..., :S] @ past[1] + probs[..., S:] @ new[1]  # [B, kv, g*n, D]
    return out.view(B, heads, n, D).transpose(1, 2).reshape(B, n, heads * D)


def attention_step(
    x: torch.Tensor,  # [B, n, H] residual stream before this layer's MLP output is added
    mlp_out: torch.Tensor,  # [B*n, H] the previous layer's MLP output (zeros before layer 0)
    cos: torch.Tensor,  # [B, n, D]
    sin: torch.Tensor,  # [B, n, D]
    visible: torch.Tensor,  # [B, n, S+n] bool
    past_k: torch.Tensor,  # [B, kv, S, D]
    past_v: torch.Tensor,  # [B, kv, S, D]
    input_norm: torch.Tensor,  # [H]
    qkv_t: torch.Tensor,  # [H, (heads + 2*kv)*D]
    qkv_bias: torch.Tensor | None,
    o_t: torch.Tensor,  # [heads*D, H]
    o_bias: torch.Tensor | None,
    q_norm: torch.Tensor,  # [D]
    k_norm: torch.Tensor,  # [D]
    post_norm: torch.Tensor,  # [H]
    router_t: torch.Tensor | None,  # [H, E] for a MoE layer, None for a dense one
    *,
    num_heads: int,
    eps: float,
    top_k: int,
    norm_topk: bool,
) -> tuple[torch.Tensor, ...]:
    """One layer up to its MLP: (the residual entering it [B, n, H] (the previous layer's output),
    x after attention [B, n, H], h [B*n, H] normed for the MLP, new k and v [B, kv, n, D], and for
    a MoE layer topk_ids [B*n, K] and topk_weights [B*n, K] float32)."""
    B, n, H = x.shape
    kv, D = past_k.shape[1], past_k.shape[3]
    entering = x + mlp_out.view(B, n, H).to(x.dtype)
    h = rms_norm(entering, input_norm, eps)
    q, k, v = linear(h, qkv_t, qkv_bias).split([num_heads * D, kv * D, kv * D], dim=-1)
    q = rotate(rms_norm(q.view(B, n, num_heads, D), q_norm, eps).transpose(1, 2), cos, sin)  # [B, heads, n, D]
    k = rotate(rms_norm(k.view(B, n, kv, D), k_norm, eps).transpose(1, 2), cos, sin)  # [B, kv, n, D]
    v = v.view(B, n, kv, D).transpose(1, 2)  # [B, kv, n, D]
    x = entering + linear(masked_attention(q, (past_k, past_v), (k, v), visible), o_t, o_bias)
    h = rms_norm(x, post_norm, eps).view(B * n, H)
    if router_t is None:
        return entering, x, h, k, v
    probs = torch.softmax(linear(h, router_t), dim=-1, dtype=torch.float32)  # [B*n, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [B*n, K]
    if norm_topk:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return entering, x, h, k, v, topk_ids, topk_weights


def gathered_experts(
    h: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] int64
    topk_weights: torch.Tensor,  # [T, K] float32
    slot_of_expert: torch.Tensor,  # [E] int64, -1 = not in this wave
    gate: torch.Tensor,  # [S, I, H]
    up: torch.Tensor,  # [S, I, H]
    down: torch.Tensor,  # [S, H, I]
) -> torch.Tensor:
    """Each assignment's slot weights read inside fused reductions -> [T, H] float32."""
    slot = slot_of_expert[topk_ids]  # [T, K]
    weight = torch.where(slot >= 0, topk_weights, 0.0)  # [T, K] absent experts add nothing
    slot = slot.clamp(min=0)
    x = h[:, None, None, :]  # [T, 1, 1, H]
    act = F.silu((x * gate[slot]).sum(-1)) * (x * up[slot]).sum(-1)  # [T, K, I]
    y = (act[:, :, None, :] * down[slot]).sum(-1)  # [T, K, H]
    return (y.float() * weight[..., None]).sum(1)


def dense_mlp(h: torch.Tensor, gate_t: torch.Tensor, up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU over transposed weights (gate_t, up_t [H, I], down_t [I, H]): h [T, H] -> [T, H]."""
    return linear(F.silu(linear(h, gate_t)) * linear(h, up_t), down_t)


def head_step(
    x: torch.Tensor,  # [B, n, H]
    mlp_out: torch.Tensor,  # [B*n, H] the last layer's MLP output
    final_norm: torch.Tensor,  # [H]
    lm_head_t: torch.Tensor,  # [H, V]
    *,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last residual stream [B, n, H] and float32 logits [B, n, V]."""
    B, n, H = x.shape
    x = x + mlp_out.view(B, n, H).to(x.dtype)
    return x, linear(rms_norm(x, final_norm, eps), lm_head_t).float()


def whole_step(
    ids: torch.Tensor,  # [B, n] int64
    lengths: torch.Tensor,  # [B] int64
    past_k: torch.Tensor,  # [L, B, kv, S, D]
    past_v: torch.Tensor,  # [L, B, kv, S, D]
    embed: torch.Tensor,  # [V, H]
    inv_freq: torch.Tensor,  # [D/2] float32
    layers: tuple[tuple[Any, ...], ...],  # per layer: attention_step's weights, in its order (None: no bias)
    mlps: tuple[tuple[torch.Tensor, ...], ...],  # per layer: (gate, up, down) experts [E, ...] or dense_mlp's
    final_norm: torch.Tensor,  # [H]
    lm_head_t: torch.Tensor,  # [H, V]
    *,
    rope_scale: float,
    num_heads: int,
    eps: float,
    top_k: int,
    norm_topk: bool,
) -> tuple[torch.Tensor, ...]:
    """Every layer in one graph, all experts resident (slot e holds expert e): (logits [B, n, V]
    float32, new keys and values [L, B, kv, n, D], each layer's output [L, B, n, H], topk_ids
    [B*n, L_moe, K])."""
    x, cos, sin, visible = step_inputs(ids, lengths, past_k, embed, inv_freq, rope_scale)
    B, n, H = x.shape
    mlp_out = torch.zeros((B * n, H), dtype=torch.float32, device=x.device)
    new_k, new_v, outputs, routed = [], [], [], []
    for layer, (weights, mlp) in enumerate(zip(layers, mlps)):
        outs = attention_step(
            x, mlp_out, cos, sin, visible, past_k[layer], past_v[layer], *weights,
            num_heads=num_heads, eps=eps, top_k=top_k, norm_topk=norm_topk,
        )  # fmt: skip
        entering, x, h, k, v = outs[:5]
        if layer:
            outputs.append(entering)
        new_k.append(k)
        new_v.append(v)
        if len(outs) == 5:
            mlp_out = dense_mlp(h, *mlp)
            continue
        topk_ids, topk_weights = outs[5:]
        routed.append(topk_ids)
        identity = torch.arange(mlp[0].shape[0], device=x.device)  # [E]
        mlp_out = gathered_experts(h, topk_ids, topk_weights, identity, *mlp)
    x, logits = head_step(x, mlp_out, final_norm, lm_head_t, eps=eps)
    outputs.append(x)
    routed_ids = torch.stack(routed, dim=1) if routed else topk_ids_none(B * n, top_k, x.device)
    return logits, torch.stack(new_k), torch.stack(new_v), torch.stack(outputs), routed_ids


def topk_ids_none(tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
    """[T, 0, K] int64: the routed ids of a model without MoE layers."""
    return torch.zeros((tokens, 0, top_k), dtype=torch.int64, device=device)
