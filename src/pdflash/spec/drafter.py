"""The DFlash block-diffusion drafter: config, checkpoint loading, pairing checks, batched forward.

Owns the drafter's math as DFLASH.md specifies it (context injected as extra keys/values in
every layer, non-causal block attention, one forward per round). It borrows the target's
embedding table and LM head and never touches the target's caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from pdflash.errors import CheckpointError
from pdflash.target.attention import attend
from pdflash.target.checkpoint import Checkpoint
from pdflash.target.config import ModelConfig, RopeConfig, read_config_json, rope_config
from pdflash.target.kv_cache import KVCache
from pdflash.target.model import rms_norm, swiglu
from pdflash.target.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from pdflash.spec.draft_steps import DraftSteps


def default_tap_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Taps spread evenly over the target when the checkpoint does not name them."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@attrs.frozen(kw_only=True)
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    block_size: int  # tokens per drafted block, anchor included
    mask_token_id: int
    num_target_layers: int
    tap_layers: tuple[int, ...]  # target layers whose residual stream feeds `fc`
    causal: tuple[bool, ...]  # per layer: sliding-attention layers are causal, full ones see the whole block
    sliding_window: tuple[int | None, ...]  # per layer: window size, None = unbounded
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> DrafterConfig:
        dflash = raw.get("dflash_config") or {}

        def field(name: str, default: Any = None) -> Any:
            value = dflash.get(name, raw.get(name, default))
            if value is None:
                raise CheckpointError(f"{source}: missing drafter field {name!r}")
            return value

        num_layers = int(field("num_hidden_layers"))
        num_target = int(field("num_target_layers"))
        taps = dflash.get("target_layer_ids") or default_tap_layers(num_target, num_layers)
        layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None  # as Qwen3Config reads it
        num_heads = int(field("num_attention_heads"))
        softcap = dflash.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
        return cls(
            hidden_size=int(field("hidden_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or int(field("hidden_size")) // num_heads),
            intermediate_size=int(field("intermediate_size")),
            vocab_size=int(field("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope_config(raw, source),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=int(field("block_size", 16)),
            mask_token_id=int(field("mask_token_id")),
            num_target_layers=num_target,
            tap_layers=tuple(int(t) for t in taps),
            causal=tuple(t == "sliding_attention" for t in layer_types),
            sliding_window=tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types),
            input_embedding_scale=float(field("input_embedding_scale", 1.0)),
            output_multiplier=float(field("output_multiplier", 1.0)),
            logit_softcap=float(softcap) if softcap else None,
        )

    def check_pairing(self, target: ModelConfig, fc_in_features: int, source: str) -> None:
        """Clear errors for a drafter that cannot work with this target."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is not below the target vocab_size {target.vocab_size}"
            )
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} must be >= 2")
        bad_taps = [t for t in self.tap_layers if not 0 <= t < target.num_layers]
        if bad_taps:
            problems.append(f"target_layer_ids {bad_taps} are not below the target's {target.num_layers} layers")
        expected_fc = len(self.tap_layers) * target.hidden_size
        if fc_in_features != expected_fc:
            problems.append(
                f"fc.in_features {fc_in_features} != {len(self.tap_layers)} taps x hidden_size {target.hidden_size}"
            )
        if problems:
            raise CheckpointError(f"{source}: drafter does not fit the target: " + "; ".join(problems))


@attrs.frozen(kw_only=True)
class DraftLayer:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [heads*D, H]
    kv_proj: torch.Tensor  # [2*kv*D, H]: k_proj and v_proj stacked (one matmul over context and block)
    o_proj: torch.Tensor  # [H, heads*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [I,H], up [I,H], down [H,I]
    biases: tuple[torch.Tensor | None, ...] = (None, None, None)  # q [heads*D], kv [2*kv*D], o [H]


class DFlashDrafter:
    """One forward drafts a block for each of N sessions from their new context features."""

    def __init__(self, config: DrafterConfig, layers: list[DraftLayer], *, fc, hidden_norm, norm, embed, lm_head):
        self.config = config
        self.layers = layers
        self.fc = fc  # [H, n_taps*H]
        self.hidden_norm = hidden_norm  # [H]
        self.norm = norm  # [H]
        self.embed = embed  # [V, H] the target's
        self.lm_head = lm_head  # [V, H] the target's
        self.rotary = Rotary(config.rope, config.head_dim)
        self.steps: DraftSteps | None = None  # static-shape (compiled) draft steps, when installed

    def new_cache(self) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.embed.dtype, self.embed.device)

    @torch.inference_mode()
    def draft_logits(
        self, contexts: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor], caches: Sequence[KVCache]
    ) -> list[torch.Tensor]:
        """contexts[i]: [c_i, n_taps*H] taps not yet seen; blocks[i]: [b_i] anchor + masks.

        Returns per session [b_i - 1, V] float32 logits for positions start+1 … start+b_i-1.
        Each cache keeps the context K/V; block K/V are scratch.
        """
        if self.steps is not None:
            shape = self.steps.shape_of(contexts, blocks)
            if not isinstance(shape, str):
                return self.steps.draft_logits(contexts, blocks, caches, shape)
            self.steps.fall_back(shape)
        cfg = self.config
        ctx_lens = [int(c.shape[0]) for c in contexts]
        block_lens = [int(b.numel()) for b in blocks]
        for cache, c, b in zip(caches, ctx_lens, block_lens, strict=True):
            cache.reserve(cache.length + c + b)
        ctx = rms_norm(F.linear(torch.cat(list(contexts)), self.fc), self.hidden_norm, cfg.rms_norm_eps)  # [C, H]
        block_ids = torch.cat(list(blocks)).to(self.embed.device)  # [Bt] the engine builds blocks on the host
        x = F.embedding(block_ids, self.embed) * cfg.input_embedding_scale  # [Bt, H]
        positions = torch.cat(
            [torch.arange(cache.length, cache.length + c) for cache, c in zip(caches, ctx_lens)]
            + [
                torch.arange(cache.length + c, cache.length + c + b)
                for cache, c, b in zip(caches, ctx_lens, block_lens)
            ]
        ).to(x.device)  # [C + Bt]: every session's context, then every session's block
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(index, layer, ctx, h, cos, sin, caches, ctx_lens, block_lens)
            x = x + swiglu(rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps), *layer.mlp)
        for cache, c in zip(caches, ctx_lens):
            cache.advance(c)
        hidden = rms_norm(x, self.norm, cfg.rms_norm_eps)  # [Bt, H]
        # every block row, anchors included: on the CPU 8 rows multiply faster than the 7 drafted ones
        logits = F.linear(hidden, self.lm_head).float() * cfg.output_multiplier  # [Bt, V]
        if cfg.logit_softcap:
            logits = torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap
        return [block_logits[1:] for block_logits in logits.split(block_lens)]

    def _attention(self, index, layer: DraftLayer, ctx, h, cos, sin, caches, ctx_lens, block_lens):
        cfg = self.config
        D, C = cfg.head_dim, ctx.shape[0]
        q_bias, kv_bias, o_bias = layer.biases
        q = rms_norm(F.linear(h, layer.q_proj, q_bias).view(-1, cfg.num_heads, D), layer.q_norm, cfg.rms_norm_eps)
        k, v = F.linear(torch.cat([ctx, h]), layer.kv_proj, kv_bias).view(-1, 2, cfg.num_kv_heads, D).unbind(1)
        k = apply_rotary(rms_norm(k, layer.k_norm, cfg.rms_norm_eps).transpose(0, 1), cos, sin)  # [kv, C+Bt, D]
        v = v.transpose(0, 1)  # [kv, C+Bt, D]
        q = apply_rotary(q.transpose(0, 1), cos[C:], sin[C:])  # [heads, Bt, D]
        causal, window = cfg.causal[index], cfg.sliding_window[index]
        outputs, c0, b0 = [], 0, 0
        for cache, c, b in zip(caches, ctx_lens, block_lens):
            ctx_rows, block_rows = slice(c0, c0 + c), slice(C + b0, C + b0 + b)
            keys, values = cache.write(
                index,
                torch.cat([k[:, ctx_rows], k[:, block_rows]], dim=1),
                torch.cat([v[:, ctx_rows], v[:, block_rows]], dim=1),
            )  # [kv, past+c+b, D]
            mask = _causal_mask(b, keys.shape[1], window, h.device) if causal else None
            outputs.append(attend(q[:, b0 : b0 + b], keys, values, mask))  # [heads, b, D]
            c0, b0 = c0 + c, b0 + b
        attn = torch.cat(outputs, dim=1).transpose(0, 1).reshape(h.shape[0], cfg.num_heads * D)  # [Bt, heads*D]
        return F.linear(attn, layer.o_proj, o_bias)


def _causal_mask(queries: int, keys: int, window: int | None, device) -> torch.Tensor:
    """Sliding-attention layers of published drafters are causal, within the window if one is set."""
    q_pos = torch.arange(keys - queries, keys, device=device)[:, None]
    k_pos = torch.arange(keys, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    return visible  # [queries, keys]


def load_drafter(directory: Path | str, target, *, progress: bool = False) -> DFlashDrafter:
    """Load a DFlash checkpoint unchanged and pair it with `target` (a Qwen3MoeModel)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    cfg = DrafterConfig.from_dict(read_config_json(config_path, "a DFlash drafter directory"), str(config_path))
    checkpoint = Checkpoint(directory)
    fc_info = checkpoint.tensors.get("fc.weight")
    if fc_info is None:
        raise CheckpointError(f"{directory}: tensor 'fc.weight' is missing from the drafter checkpoint")
    cfg.check_pairing(target.config, fc_info.shape[-1], str(directory))
    dtype, device = target.dtype, target.device
    H, D = cfg.hidden_size, cfg.head_dim

    def load(name: str, *shape: int) -> torch.Tensor:
        return checkpoint.load(name, shape, dtype).to(device)

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qd, kvd = cfg.num_heads * D, cfg.num_kv_heads * D
        biases: tuple[torch.Tensor | None, ...] = (None, None, None)  # no attention biases
        if cfg.attention_bias:
            q_bias, k_bias, v_bias, o_bias = (
                load(p + f"self_attn.{n}_proj.bias", size) for n, size in zip("qkvo", (qd, kvd, kvd, H))
            )
            biases = (q_bias, torch.cat([k_bias, v_bias]), o_bias)
        layers.append(
            DraftLayer(
                input_norm=load(p + "input_layernorm.weight", H),
                post_attention_norm=load(p + "post_attention_layernorm.weight", H),
                q_proj=load(p + "self_attn.q_proj.weight", qd, H),
                kv_proj=torch.cat(
                    [load(p + "self_attn.k_proj.weight", kvd, H), load(p + "self_attn.v_proj.weight", kvd, H)]
                ),
                o_proj=load(p + "self_attn.o_proj.weight", H, qd),
                q_norm=load(p + "self_attn.q_norm.weight", D),
                k_norm=load(p + "self_attn.k_norm.weight", D),
                mlp=(
                    load(p + "mlp.gate_proj.weight", cfg.intermediate_size, H),
                    load(p + "mlp.up_proj.weight", cfg.intermediate_size, H),
                    load(p + "mlp.down_proj.weight", H, cfg.intermediate_size),
                ),
                biases=biases,
            )
        )
    return DFlashDrafter(
        cfg,
        layers,
        fc=load("fc.weight", H, len(cfg.tap_layers) * H),
        hidden_norm=load("hidden_norm.weight", H),
        norm=load("norm.weight", H),
        embed=target.embed,
        lm_head=target.lm_head,
    )
