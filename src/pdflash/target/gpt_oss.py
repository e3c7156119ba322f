"""Inference-only gpt-oss: sink attention over sliding and full layers, clamped-SwiGLU experts.

Same forward contract as `Qwen3MoeModel` (token ids of N sequences and their KV caches in,
`BatchOutput` with logits, taps and routed expert ids out), so the speculator, engine and
offloading serve either family. Experts come from a provider in waves (`gpt_oss_experts`);
MXFP4 experts are dequantized only when a routed expert is computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from pdflash import kernels
from pdflash.kernels.routing import permutation
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_experts import GptOssExpertProvider
from pdflash.target.kv_cache import KVCache
from pdflash.target.model import BatchOutput, logit_rows
from pdflash.target.rope import Rotary, apply_rotary
from pdflash.target.sink_attention import attend_with_sinks, visible_keys


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss's RMS norm: the weight multiplies in float32 before the cast back (transformers keeps it float32)."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


@attrs.frozen(kw_only=True)
class GptOssLayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    qkv_proj: torch.Tensor  # [(heads + 2*kv)*D, H]: q, k, v stacked
    qkv_bias: torch.Tensor | None  # [(heads + 2*kv)*D]
    o_proj: torch.Tensor  # [H, heads*D]
    o_bias: torch.Tensor | None  # [H]
    sinks: torch.Tensor  # [heads]
    router: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E]


class GptOssModel:
    """Weights are plain tensors; experts come from `experts`."""

    def __init__(
        self,
        config: GptOssConfig,
        *,
        embed: torch.Tensor,
        layers: list[GptOssLayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        experts: GptOssExpertProvider,
    ) -> None:
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [V, H]
        self.experts = experts
        self.rotary = Rotary(config.rope, config.head_dim)

    # dtype, device, new_cache and forward's signature repeat Qwen3MoeModel's: one model contract, per family
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
        """As `Qwen3MoeModel.forward`: new tokens of N sequences (each [n_i]) after their caches."""
        # the batch prologue and epilogue are Qwen3MoeModel.forward's on purpose: each family's forward
        # stays one self-contained pass (model.py's hot path is tuned on its own), only the layers differ
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
        masks = {
            window: [visible_keys(c.length, n, window, self.device) for c, n in zip(caches, seq_lens)]
            for window in set(cfg.layer_windows)
        }  # window -> per sequence [n, past+n] or None
        x = F.embedding(ids, self.embed)  # [T, H]
        tapped: dict[int, torch.Tensor] = {}
        routed = torch.empty((x.shape[0], cfg.num_layers, cfg.top_k), dtype=torch.int64, device=self.device)
        for layer, weights in enumerate(self.layers):
            h = rms_norm(x, weights.input_norm, cfg.rms_norm_eps)
            window_masks = masks[cfg.layer_windows[layer]]
            x = x + self._attention(layer, weights, h, cos, sin, caches, seq_lens, window_masks)
            h = rms_norm(x, weights.post_attention_norm, cfg.rms_norm_eps)
            mlp_out, routed[:, layer] = self._moe(layer, weights, h, skip_experts)
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

    def _attention(self, layer, w: GptOssLayerWeights, h, cos, sin, caches, seq_lens, masks) -> torch.Tensor:
        cfg = self.config
        T, D = h.shape[0], cfg.head_dim
        q, k, v = F.linear(h, w.qkv_proj, w.qkv_bias).split(
            [cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], dim=-1
        )
        q = apply_rotary(q.reshape(T, cfg.num_heads, D).transpose(0, 1), cos, sin)  # [heads, T, D]
        k = apply_rotary(k.reshape(T, cfg.num_kv_heads, D).transpose(0, 1), cos, sin)  # [kv, T, D]
        v = v.reshape(T, cfg.num_kv_heads, D).transpose(0, 1)  # [kv, T, D]
        outputs, start = [], 0
        for cache, n, visible in zip(caches, seq_lens, masks):
            keys, values = cache.write(layer, k[:, start : start + n], v[:, start : start + n])  # [kv, past+n, D]
            outputs.append(attend_with_sinks(q[:, start : start + n], keys, values, visible, w.sinks))
            start += n
        attn = torch.cat(outputs, dim=1).transpose(0, 1).reshape(T, cfg.num_heads * D)  # [T, heads*D]
        return F.linear(attn, w.o_proj, w.o_bias)

    def _moe(self, layer: int, w: GptOssLayerWeights, h: torch.Tensor, skip_experts: bool):
        cfg = self.config
        logits = F.linear(h, w.router, w.router_bias)  # [T, E]
        top_logits, top_ids = torch.topk(logits, cfg.top_k, dim=-1)  # [T, K]
        routing = permutation(top_ids, torch.softmax(top_logits.float(), dim=-1), cfg.num_experts)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)  # [T, H]
        if not skip_experts:
            for wave in self.experts.waves(layer, routing.union_ids().tolist()):
                kernels.clamped_swiglu(
                    h,
                    routing,
                    wave.gate_up,
                    wave.gate_up_scales,
                    wave.gate_up_bias,
                    wave.down,
                    wave.down_scales,
                    wave.down_bias,
                    wave.slot_of_expert,
                    out,
                    limit=cfg.swiglu_limit,
                    alpha=cfg.swiglu_alpha,
                )
        return out.to(h.dtype), routing.topk_ids
