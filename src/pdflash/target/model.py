"""The Qwen3-MoE target in plain torch: one forward over a ragged batch of sequences.

Owns the model math (embeddings, RMSNorm, GQA attention with q/k norm and RoPE, MoE and
dense MLP blocks, LM head). Expert weights come through an `ExpertProvider`; expert
compute goes through the `kernels` dispatcher. Sequence bookkeeping (what to feed, when to
crop) belongs to callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.nn.functional as F

import pdflash.kernels as kernels
from pdflash.target.attention import attend
from pdflash.target.config import ModelConfig
from pdflash.target.experts import ExpertProvider
from pdflash.target.kv_cache import KVCache
from pdflash.target.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from pdflash.target.compiled import TargetSteps


@attrs.frozen(kw_only=True)
class AttentionWeights:
    qkv_proj: torch.Tensor  # [(heads + 2*kv_heads)*D, H]: q_proj, k_proj, v_proj stacked (one matmul)
    o_proj: torch.Tensor  # [H, heads*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    qkv_bias: torch.Tensor | None = None  # [(heads + 2*kv_heads)*D]
    o_bias: torch.Tensor | None = None


@attrs.frozen(kw_only=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    attention: AttentionWeights
    router: torch.Tensor | None  # [E, H] for MoE layers
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (gate [I,H], up [I,H], down [H,I])


@attrs.frozen(kw_only=True)
class BatchOutput:
    seq_lens: tuple[int, ...]  # new tokens per sequence, in batch order
    logit_lens: tuple[int, ...]  # logit rows per sequence: its tokens, or 1 (its last token's only)
    logits: torch.Tensor  # [R, V] float32, R = sum(logit_lens): each sequence's rows in batch order
    taps: torch.Tensor | None  # [T, n_taps*H] residual stream after each requested layer
    routed: torch.Tensor  # [T, L_moe, K] int64 expert ids routed per token and MoE layer

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sequence views of a [T, ...] tensor."""
        return tensor.split(list(self.seq_lens))

    def split_logits(self) -> tuple[torch.Tensor, ...]:
        """Per-sequence [logit_lens[i], V] views of the logits."""
        return self.logits.split(list(self.logit_lens))

    def split_taps(self) -> list[torch.Tensor | None]:
        """Per-sequence [t_i, n_taps*H] tap features; None for each when no taps were asked for."""
        return list(self.split(self.taps)) if self.taps is not None else [None] * len(self.seq_lens)


def logit_rows(
    seq_lens: Sequence[int], last_logits_only: bool | Sequence[bool], device: torch.device
) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """Which rows of a forward's [T, H] final states get logits: an index (None: every row) and
    each sequence's count. `last_logits_only`: for every sequence, or per sequence (a batch that
    prefills some prompts, where only the last token's logits count, and verifies other blocks)."""
    last = [last_logits_only] * len(seq_lens) if isinstance(last_logits_only, bool) else list(last_logits_only)
    if len(last) != len(seq_lens):
        raise ValueError(f"last_logits_only has {len(last)} flags for {len(seq_lens)} sequences")
    if not any(last):
        return None, tuple(seq_lens)
    ends = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0)
    rows = [
        torch.arange(end - n, end) if not only else end[None] - 1
        for n, end, only in zip(seq_lens, ends, last, strict=True)
    ]
    return torch.cat(rows).to(device), tuple(1 if only else n for n, only in zip(seq_lens, last, strict=True))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class Qwen3MoeModel:
    """Inference-only Qwen3-MoE. Weights are plain tensors; experts come from `experts`."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        experts: ExpertProvider,
    ) -> None:
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [V, H]
        self.experts = experts
        self.rotary = Rotary(config.rope, config.head_dim)
        self.moe_index = {layer: i for i, layer in enumerate(config.moe_layer_ids)}
        self.steps: TargetSteps | None = None  # static-shape (compiled) steps, when installed

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        *,
        last_logits_only: bool | Sequence[bool] = False,
        taps: Sequence[int] = (),
        skip_experts: bool = False,
        commit: bool = True,
    ) -> BatchOutput:
        """Run new tokens of N sequences (each [n_i] int64, positions after its cache) in one pass.

        `last_logits_only` (for all, or per sequence): logits of the sequence's last token only;
        `skip_experts` computes routing but not expert outputs (a router-only pass);
        `commit=False` leaves each cache's length unchanged (the K/V written past it are scratch).
        """
        if self.steps is not None:
            if not isinstance(last_logits_only, bool):  # a static step applies one rule to every sequence
                self.steps.fall_back("a batch with prefills in it (last-token logits for some sequences only)")
            elif not isinstance(shape := self.steps.shape_of(token_ids, skip_experts), str):
                return self.steps.forward(
                    token_ids, caches, shape, last_logits_only=last_logits_only, taps=taps, commit=commit
                )
            else:
                self.steps.fall_back(shape)
        cfg = self.config
        seq_lens = tuple(int(t.numel()) for t in token_ids)
        rows, logit_lens = logit_rows(seq_lens, last_logits_only, self.device)
        for cache, n in zip(caches, seq_lens, strict=True):
            cache.reserve(cache.length + n)
        ids = torch.cat(list(token_ids)).to(self.device)  # [T]
        positions = torch.cat(
            [torch.arange(c.length, c.length + n, device=self.device) for c, n in zip(caches, seq_lens)]
        )  # [T]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, D] each
        x = F.embedding(ids, self.embed)  # [T, H]
        tapped: dict[int, torch.Tensor] = {}
        routed = torch.empty((x.shape[0], len(self.moe_index), cfg.top_k), dtype=torch.int64, device=self.device)
        for layer, weights in enumerate(self.layers):
            h = rms_norm(x, weights.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(layer, weights.attention, h, cos, sin, caches, seq_lens)
            h = rms_norm(x, weights.post_attention_norm, cfg.rms_norm_eps)
            if weights.router is not None:
                mlp_out, routed[:, self.moe_index[layer]] = self._moe(layer, weights.router, h, skip_experts)
            else:
                assert weights.dense is not None  # the loader gives a layer a router or a dense MLP
                mlp_out = swiglu(h, *weights.dense)
            x = x + mlp_out
            if layer in taps:
                tapped[layer] = x
        if commit:
            for cache, n in zip(caches, seq_lens):
                cache.advance(n)
        if rows is not None:
            x = x[rows]  # [R, H]
        logits = F.linear(rms_norm(x, self.final_norm, cfg.rms_norm_eps), self.lm_head).float()
        return BatchOutput(
            seq_lens=seq_lens,
            logit_lens=logit_lens,
            logits=logits,
            taps=torch.cat([tapped[layer] for layer in taps], dim=-1) if taps else None,
            routed=routed,
        )

    def _attention(self, layer, w: AttentionWeights, h, cos, sin, caches, seq_lens) -> torch.Tensor:
        cfg = self.config
        T, D = h.shape[0], cfg.head_dim
        q, k, v = F.linear(h, w.qkv_proj, w.qkv_bias).split(
            [cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], dim=-1
        )
        q = rms_norm(q.reshape(T, cfg.num_heads, D), w.q_norm, cfg.rms_norm_eps).transpose(0, 1)  # [heads, T, D]
        k = rms_norm(k.reshape(T, cfg.num_kv_heads, D), w.k_norm, cfg.rms_norm_eps).transpose(0, 1)  # [kv, T, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        v = v.reshape(T, cfg.num_kv_heads, D).transpose(0, 1)  # [kv_heads, T, D]
        outputs, start = [], 0
        for cache, n in zip(caches, seq_lens):
            past = cache.length
            keys, values = cache.write(layer, k[:, start : start + n], v[:, start : start + n])  # [kv, past+n, D]
            causal = torch.ones((n, past + n), dtype=torch.bool, device=h.device).tril(diagonal=past) if n > 1 else None
            outputs.append(attend(q[:, start : start + n], keys, values, causal))  # [heads, n, D]
            start += n
        attn = torch.cat(outputs, dim=1).transpose(0, 1).reshape(T, cfg.num_heads * D)  # [T, heads*D]
        return F.linear(attn, w.o_proj, w.o_bias)

    def _moe(self, layer: int, router: torch.Tensor, h: torch.Tensor, skip_experts: bool):
        cfg = self.config
        routing = kernels.route(F.linear(h, router), cfg.top_k, cfg.norm_topk_prob)  # router logits [T, E]
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)  # [T, H]
        if not skip_experts:
            for wave in self.experts.waves(layer, routing.union_ids().tolist()):
                kernels.grouped_swiglu(h, routing, wave.gate, wave.up, wave.down, wave.slot_of_expert, out)
        return out.to(h.dtype), routing.topk_ids
