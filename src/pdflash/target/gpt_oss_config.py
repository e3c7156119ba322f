"""gpt-oss configuration: parses a `model_type: gpt_oss` `config.json` into a frozen value object.

Owns what differs from Qwen3-MoE (per-layer sliding windows, the clamped SwiGLU, the
quantization method of the experts) and exposes the same core fields under the same names,
so the speculator, engine, offloading and scheduler read either family alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from pdflash.errors import CheckpointError
from pdflash.target.config import RopeConfig, rope_config

LAYER_TYPES = ("sliding_attention", "full_attention")
QUANT_METHODS = ("mxfp4",)  # besides none: the dequantized (bf16 / fp32) form


@attrs.frozen(kw_only=True)
class GptOssConfig:
    family: ClassVar[str] = "gpt_oss"

    # the fields up to eos_token_ids are ModelConfig's, by name: what family-independent code reads
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int  # SwiGLU width of one expert (the config's intermediate_size)
    num_experts: int
    top_k: int  # experts per token
    moe_layers: tuple[bool, ...]  # every layer is MoE
    rms_norm_eps: float
    rope: RopeConfig
    max_positions: int  # context limit in tokens
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # per layer: keys a query sees (itself included), None = all
    swiglu_limit: float  # gate clamped above, up clamped to +-limit
    swiglu_alpha: float  # glu = gate * sigmoid(alpha * gate)
    quant_method: str | None  # "mxfp4" = experts stored as *_blocks/*_scales, None = dequantized

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> GptOssConfig:
        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise CheckpointError(f"{source}: missing required field {key!r}")
            return raw[key]

        num_layers, num_heads = int(need("num_hidden_layers")), int(need("num_attention_heads"))
        num_experts, top_k = int(need("num_local_experts")), int(need("num_experts_per_tok"))
        if not 0 < top_k <= num_experts:
            raise CheckpointError(
                f"{source}: num_experts_per_tok={top_k} must be in 1..num_local_experts={num_experts}"
            )
        layer_types = raw.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(num_layers)]
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if len(layer_types) != num_layers or bad:
            raise CheckpointError(
                f"{source}: layer_types must list {num_layers} entries of {', '.join(LAYER_TYPES)}; got {layer_types}"
            )
        window = raw.get("sliding_window")
        if "sliding_attention" in layer_types and (window is None or int(window) < 1):
            raise CheckpointError(f"{source}: sliding_attention layers need sliding_window >= 1; got {window!r}")
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        if quant is not None and quant not in QUANT_METHODS:
            raise CheckpointError(
                f"{source}: quantization_config.quant_method {quant!r} is not supported for gpt_oss; "
                f"supported: {', '.join(QUANT_METHODS)} or none (dequantized experts)"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or int(need("hidden_size")) // num_heads),
            moe_intermediate_size=int(need("intermediate_size")),
            num_experts=num_experts,
            top_k=top_k,
            moe_layers=(True,) * num_layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope=rope_config(raw, source),
            max_positions=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", True)),
            eos_token_ids=eos_ids,
            layer_windows=tuple(int(window or 0) if t == "sliding_attention" else None for t in layer_types),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            quant_method=quant,
        )
