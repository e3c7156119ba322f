"""The DFlash drafter's forward as a static-shape step over a padded batch, compiled like the target's.

Owns the padded draft step: B sessions' new context features padded to c rows and their blocks
to b tokens, the past draft K/V gathered to a multiple of `KEY_QUANTUM` keys, one compiled call
for every layer, and the context K/V written back. A block query sees the past below the
session's length, its real context rows and its real block tokens (causal and windowed on
sliding layers, as `drafter._causal_mask`), so padding never reaches a real row. Shapes outside
the buckets (the first round's prompt-long context) run the drafter's eager forward.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pdflash.target.compiled import KEY_QUANTUM, StepBuckets, bind_step, bucket_of, log, transposed
from pdflash.target.kv_cache import KVCache, gather_past, store_new
from pdflash.target.model import rms_norm
from pdflash.target.steps import dense_mlp, linear, masked_attention

if TYPE_CHECKING:
    from pdflash.spec.drafter import DFlashDrafter


def draft_step(
    ctx: torch.Tensor,  # [B, c, n_taps*H] context features, padded rows anywhere past ctx_counts
    ctx_counts: torch.Tensor,  # [B] int64 real context rows
    block_ids: torch.Tensor,  # [B, b] int64 anchor + masks, padded past block_counts
    block_counts: torch.Tensor,  # [B] int64 real block tokens
    lengths: torch.Tensor,  # [B] int64 draft-cache length (context already seen)
    past_k: torch.Tensor,  # [L, B, kv, S, D]
    past_v: torch.Tensor,  # [L, B, kv, S, D]
    embed: torch.Tensor,  # [V, H]
    lm_head_t: torch.Tensor,  # [H, V]
    fc_t: torch.Tensor,  # [n_taps*H, H]
    hidden_norm: torch.Tensor,  # [H]
    norm: torch.Tensor,  # [H]
    inv_freq: torch.Tensor,  # [D/2] float32
    # per layer: input_norm, post_norm, q, kv, o, q_norm, k_norm, gate, up, down, q/kv/o bias (None: no bias),
    # every linear weight transposed ([in, out], `transposed`)
    layers: tuple[tuple[Any, ...], ...],
    *,
    rope_scale: float,
    num_heads: int,
    eps: float,
    embedding_scale: float,
    output_multiplier: float,
    softcap: float | None,
    causal: tuple[bool, ...],
    window: tuple[int | None, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block logits [B, b, V] float32, context keys and values [L, B, kv, c, D])."""
    B, c, _ = ctx.shape
    b, S, D = block_ids.shape[1], past_k.shape[3], past_k.shape[4]
    kv = past_k.shape[2]
    ctx_h = rms_norm(linear(ctx, fc_t), hidden_norm, eps)  # [B, c, H]
    x = F.embedding(block_ids, embed) * embedding_scale  # [B, b, H]
    rows = torch.arange(max(c, b, S), device=ctx.device)
    ctx_pos = lengths[:, None] + rows[:c]  # [B, c]
    block_pos = (lengths + ctx_counts)[:, None] + rows[:b]  # [B, b]
    k_pos = torch.cat([rows[:S].expand(B, S), ctx_pos, block_pos], dim=1)  # [B, S+c+b]
    k_real = torch.cat(
        [rows[:S] < lengths[:, None], rows[:c] < ctx_counts[:, None], rows[:b] < block_counts[:, None]], dim=1
    )  # [B, S+c+b]
    freqs = torch.cat([ctx_pos, block_pos], dim=1).float()[..., None] * inv_freq  # [B, c+b, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * rope_scale).to(x.dtype), (emb.sin() * rope_scale).to(x.dtype)  # [B, c+b, D]
    masks = {}
    for key in set(zip(causal, window)):
        visible = k_real[:, None, :].expand(B, b, -1)  # [B, b, S+c+b]
        offset = block_pos[:, :, None] - k_pos[:, None, :]  # [B, b, S+c+b] query minus key position
        if key[0]:
            visible = visible & (offset >= 0)
        if key[1] is not None:
            visible = visible & (offset < key[1])
        masks[key] = visible
    new_k, new_v = [], []
    for index, weights in enumerate(layers):
        input_norm, post_norm, q_proj, kv_proj, o_proj, q_norm, k_norm, gate, up, down, q_b, kv_b, o_b = weights
        h = rms_norm(x, input_norm, eps)
        q = rms_norm(linear(h, q_proj, q_b).view(B, b, num_heads, D), q_norm, eps)
        k, v = linear(torch.cat([ctx_h, h], dim=1), kv_proj, kv_b).view(B, c + b, 2, kv, D).unbind(2)
        k = _rotate(rms_norm(k, k_norm, eps).transpose(1, 2), cos, sin)  # [B, kv, c+b, D]
        v = v.transpose(1, 2)  # [B, kv, c+b, D]
        q = _rotate(q.transpose(1, 2), cos[:, c:], sin[:, c:])  # [B, heads, b, D]
        visible = masks[(causal[index], window[index])]
        attn = masked_attention(q, (past_k[index], past_v[index]), (k, v), visible)  # [B, b, heads*D]
        x = x + linear(attn, o_proj, o_b)
        hn = rms_norm(x, post_norm, eps)
        x = x + dense_mlp(hn.view(B * b, -1), gate, up, down).view(B, b, -1)
        new_k.append(k[:, :, :c])
        new_v.append(v[:, :, :c])
    logits = linear(rms_norm(x, norm, eps), lm_head_t).float() * output_multiplier  # [B, b, V]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits, torch.stack(new_k), torch.stack(new_v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, heads, n, D] by cos, sin [B, n, D]."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


class DraftSteps:
    """Runs `DFlashDrafter.draft_logits` through the padded step when contexts and blocks fit a bucket."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        buckets: StepBuckets,
        *,
        compiled: bool = True,
        lm_head_t: torch.Tensor | None = None,  # the target steps' transposed head, when the drafter shares it
    ) -> None:
        self.drafter, self.buckets, self.compiled = drafter, buckets, compiled
        cfg = drafter.config
        device = drafter.embed.device
        self._inv_freq = drafter.rotary.inv_freq.to(device)
        self._layers = tuple(
            (w.input_norm, w.post_attention_norm, *map(transposed, (w.q_proj, w.kv_proj, w.o_proj)), w.q_norm,
             w.k_norm, *map(transposed, w.mlp), *w.biases)
            for w in drafter.layers
        )  # fmt: skip
        self._lm_head_t = transposed(drafter.lm_head) if lm_head_t is None else lm_head_t  # [H, V]
        self._fc_t = transposed(drafter.fc)
        options = {
            "rope_scale": drafter.rotary.scale,
            "num_heads": cfg.num_heads,
            "eps": cfg.rms_norm_eps,
            "embedding_scale": cfg.input_embedding_scale,
            "output_multiplier": cfg.output_multiplier,
            "softcap": cfg.logit_softcap,
            "causal": cfg.causal,
            "window": cfg.sliding_window,
        }
        weights = (
            drafter.embed,
            self._lm_head_t,
            self._fc_t,
            drafter.hidden_norm,
            drafter.norm,
            self._inv_freq,
            self._layers,
        )
        self._step = bind_step(draft_step, device, weights, options, key_dims={5: 3, 6: 3}, compiled=compiled)
        self.fallbacks: Counter[str] = Counter()
        self.warm_up_s = 0.0

    def shape_of(self, contexts: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor]) -> tuple[int, int, int] | str:
        """(batch, context, block) buckets, or why none fits."""
        ctx_rows = [int(t.shape[0]) for t in contexts]
        block_rows = [int(t.numel()) for t in blocks]
        if not ctx_rows or min(ctx_rows) < 1 or min(block_rows) < 1:
            return "an empty batch, context or block"
        batch = bucket_of(len(ctx_rows), self.buckets.batch)
        ctx = bucket_of(max(ctx_rows), self.buckets.tokens)
        block = bucket_of(max(block_rows), self.buckets.tokens)
        if batch is None:
            return f"more sessions than the largest batch bucket ({self.buckets.batch[-1]})"
        if ctx is None or block is None:  # the first round's context is the whole prompt
            return f"a context or block longer than the largest token bucket ({self.buckets.tokens[-1]} tokens)"
        return batch, ctx, block

    def fall_back(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        (log.info if self.fallbacks[reason] == 1 else log.debug)("eager draft forward: %s", reason)

    @torch.inference_mode()
    def draft_logits(
        self,
        contexts: Sequence[torch.Tensor],
        blocks: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        shape: tuple[int, int, int],
    ) -> list[torch.Tensor]:
        """Same contract and cache effects as `DFlashDrafter.draft_logits`."""
        d = self.drafter
        batch, ctx_n, block_n = shape
        device = d.embed.device
        ctx_rows = [int(t.shape[0]) for t in contexts]
        block_rows = [int(t.numel()) for t in blocks]
        lengths = [c.length for c in caches]
        keys = -(-max(lengths) // KEY_QUANTUM) * KEY_QUANTUM or KEY_QUANTUM
        for cache, n in zip(caches, ctx_rows, strict=True):
            cache.reserve(max(keys, cache.length + n))
        ctx = torch.zeros((batch, ctx_n, contexts[0].shape[1]), dtype=contexts[0].dtype, device=device)
        ids = torch.zeros((batch, block_n), dtype=torch.int64)
        for row, (context, block) in enumerate(zip(contexts, blocks)):
            ctx[row, : ctx_rows[row]] = context
            ids[row, : block_rows[row]] = block
        past_k, past_v = gather_past(caches, keys, batch)  # [L, B, kv, S, D]
        if self.compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        pad = [0] * (batch - len(caches))

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values + pad, dtype=torch.int64, device=device)

        logits, new_k, new_v = self._step(
            ctx, column(ctx_rows), ids.to(device), column(block_rows), column(lengths), past_k, past_v
        )
        store_new(caches, ctx_rows, new_k, new_v, commit=True)
        return [logits[row, 1:n].clone() for row, n in enumerate(block_rows)]

    def warm_up(self, *, progress: bool = False) -> float:
        """Run every (batch, token) bucket once over scratch caches (context and block of the same bucket)."""
        started = time.perf_counter()
        d = self.drafter
        taps = len(d.config.tap_layers) * d.config.hidden_size
        shapes = [(b, n) for n in self.buckets.tokens for b in self.buckets.batch]
        for batch, tokens in tqdm(shapes, desc="compiling draft steps", disable=not progress):
            ctx = [torch.zeros((tokens, taps), dtype=d.embed.dtype, device=d.embed.device)] * batch
            blocks = [torch.ones(tokens, dtype=torch.int64)] * batch
            self.draft_logits(ctx, blocks, [d.new_cache() for _ in range(batch)], (batch, tokens, tokens))
        self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s
