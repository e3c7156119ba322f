"""Target model configuration: parses a Qwen3-MoE `config.json` into a frozen value object.

Owns config validation and the per-layer MoE/dense decision, and the choice of family by
`model_type` (gpt-oss parses in `gpt_oss_config`); knows nothing of tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from pdflash.errors import CheckpointError

if TYPE_CHECKING:
    from pdflash.target.gpt_oss_config import GptOssConfig

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@attrs.frozen(kw_only=True)
class RopeConfig:
    theta: float  # base wavelength
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / yarn context extension factor
    original_max_positions: int | None = None  # yarn: pre-training context length
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: cos/sin scale (derived from factor if None)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@attrs.frozen(kw_only=True)
class ModelConfig:
    family: ClassVar[str] = "qwen3_moe"

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate_size: int  # SwiGLU width of dense (mlp_only) layers
    moe_intermediate_size: int  # SwiGLU width of one expert
    num_experts: int
    top_k: int  # experts per token
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: True = MoE block, False = dense MLP
    rms_norm_eps: float
    rope: RopeConfig
    max_positions: int  # context limit in tokens
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_dict(read_config_json(path, "a Hugging Face model directory"), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported for qwen3_moe")

        def need(key: str, *aliases: str) -> Any:
            for name in (key, *aliases):
                if raw.get(name) is not None:
                    return raw[name]
            raise CheckpointError(f"{source}: missing required field {key!r}")

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_experts = int(need("num_experts", "num_local_experts"))
        sparse_step = int(raw.get("decoder_sparse_step", 1))
        mlp_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0 for i in range(num_layers)
        )
        top_k = int(need("num_experts_per_tok"))
        if any(moe_layers) and not 0 < top_k <= num_experts:
            raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            dense_intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope_config(raw, source),
            max_positions=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
        )


FAMILIES = ("qwen3_moe", "gpt_oss")  # model_type values pdflash serves


def load_model_config(path: Path) -> ModelConfig | GptOssConfig:
    """The config of the family `config.json` at `path` names in its `model_type`."""
    return model_config_from_dict(read_config_json(path, "a Hugging Face model directory"), source=str(path))


def model_config_from_dict(raw: dict[str, Any], source: str = "config") -> ModelConfig | GptOssConfig:
    model_type = raw.get("model_type")
    if model_type == "gpt_oss":
        from pdflash.target.gpt_oss_config import GptOssConfig

        return GptOssConfig.from_dict(raw, source)
    if model_type not in FAMILIES:
        raise CheckpointError(f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return ModelConfig.from_dict(raw, source)


def read_config_json(path: Path, owner: str) -> dict[str, Any]:
    """The parsed `config.json` at `path`; `owner` says whose config it is in the error."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json ({owner} needs one)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    """Reads both layouts: `rope_theta` + `rope_scaling` (hub checkpoints) and `rope_parameters` (transformers 5)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor != 1 is not supported")
    max_positions = int(raw.get("max_position_embeddings", 0))
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        original_max_positions=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
