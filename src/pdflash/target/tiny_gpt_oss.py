"""Writes small random gpt-oss checkpoints (HF layout, MXFP4 or dequantized experts, harmony chat).

The MXFP4 form packs each expert with `pdflash.kernels.pack_mxfp4`, laid out as the published
checkpoints are (see `gpt_oss_layout`). Random weights generate noise, not text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdflash.kernels.mxfp4 import pack_mxfp4
from pdflash.target.harmony_template import HARMONY_SPECIAL_TOKENS, HARMONY_TEMPLATE
from pdflash.target.tiny import byte_level_tokenizer

# gpt-oss's config.json keys at TINY_CONFIG's scale (the same hidden size, layers and heads on purpose)
TINY_GPT_OSS_CONFIG: dict[str, Any] = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "vocab_size": 256 + len(HARMONY_SPECIAL_TOKENS),
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 256,
    },
    "max_position_embeddings": 1024,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def random_gpt_oss_tensors(config: dict[str, Any], generator: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """Every tensor of a dequantized gpt-oss checkpoint (transformers' names and layout), random."""
    H, I, E = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    D, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    tensors = {"model.embed_tokens.weight": randn(config["vocab_size"], H), "model.norm.weight": 1 + randn(H)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(config["vocab_size"], H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", heads * D), ("k_proj", kv * D), ("v_proj", kv * D)):
            tensors |= {p + f"self_attn.{name}.weight": randn(rows, H), p + f"self_attn.{name}.bias": randn(rows)}
        tensors |= {
            p + "self_attn.o_proj.weight": randn(H, heads * D),
            p + "self_attn.o_proj.bias": randn(H),
            p + "self_attn.sinks": randn(heads) * 10,
            p + "input_layernorm.weight": 1 + randn(H),
            p + "post_attention_layernorm.weight": 1 + randn(H),
            p + "mlp.router.weight": randn(E, H),
            p + "mlp.router.bias": randn(E),
            p + "mlp.experts.gate_up_proj": randn(E, H, 2 * I),
            p + "mlp.experts.gate_up_proj_bias": randn(E, 2 * I),
            p + "mlp.experts.down_proj": randn(E, I, H),
            p + "mlp.experts.down_proj_bias": randn(E, H),
        }
    return tensors


def quantize_experts(
    tensors: dict[str, torch.Tensor], bias_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The MXFP4 form of a dequantized checkpoint's tensors: experts packed, biases in `bias_dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(tensor.transpose(1, 2).contiguous())  # [E, out, in] -> blocks, scales
            out |= {name + "_blocks": blocks, name + "_scales": scales}
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            out[name] = tensor.to(bias_dtype)
        else:
            out[name] = tensor
    return out


def write_gpt_oss_checkpoint(
    directory: Path | str, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, mxfp4: bool = True
) -> Path:
    """Write `tensors` (dequantized form) as a checkpoint, MXFP4-packed when `mxfp4`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if mxfp4:
        tensors = quantize_experts(tensors)
        config["quantization_config"] = MXFP4_QUANTIZATION
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_harmony_tokenizer(directory: Path, config: dict[str, Any]) -> None:
    """A byte-level tokenizer with the harmony special tokens and the harmony chat template."""
    tokenizer = byte_level_tokenizer(HARMONY_SPECIAL_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"chat_template": HARMONY_TEMPLATE, "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    eos = [tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")]
    config["eos_token_id"] = eos


def write_tiny_gpt_oss(
    directory: Path | str,
    *,
    seed: int = 0,
    std: float = 0.1,
    mxfp4: bool = True,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """A random gpt-oss checkpoint, MXFP4 by default, with a harmony tokenizer and template."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = TINY_GPT_OSS_CONFIG | overrides
    tensors = random_gpt_oss_tensors(config, torch.Generator().manual_seed(seed), std)
    if with_tokenizer:
        write_harmony_tokenizer(directory, config)
    return write_gpt_oss_checkpoint(directory, config, tensors, mxfp4=mxfp4)
