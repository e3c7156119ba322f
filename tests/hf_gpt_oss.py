"""Tiny random gpt-oss checkpoints whose weights `transformers`' `GptOssForCausalLM` initialised (the oracle).

Each is written in both forms pdflash loads: MXFP4 (experts packed as the published checkpoints
are) and dequantized bf16. transformers reads either back itself (dequantizing MXFP4 on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdflash.target.tiny_gpt_oss import write_gpt_oss_checkpoint

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
HF_GPT_OSS_CONFIGS = {
    # learned sinks, alternating sliding (window 16) and full layers, YaRN RoPE, GQA 2:1
    "sinks_sliding_yarn": dict(
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=YARN,
    ),
    # four experts per token, a window of 4 (shorter than every prompt), one kv head
    "top4_window4": dict(
        num_key_value_heads=1,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
FORMS = ("mxfp4", "bf16")


def hf_gpt_oss_config(name: str):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        head_dim=16,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        **HF_GPT_OSS_CONFIGS[name],
    )


def write_hf_gpt_oss(directory: Path, name: str, form: str, seed: int = 0) -> Path:
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    config = hf_gpt_oss_config(name)
    tensors = {k: v.detach().clone() for k, v in GptOssForCausalLM(config).state_dict().items()}
    if form == "bf16":
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    raw = config.to_dict() | {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}
    return write_gpt_oss_checkpoint(directory, raw, tensors, mxfp4=form == "mxfp4")


def load_hf_gpt_oss(directory: Path):
    """transformers' own reading of the checkpoint at `directory`, float32 (MXFP4 dequantized)."""
    import json

    from transformers import GptOssForCausalLM, Mxfp4Config

    quantized = "quantization_config" in json.loads((directory / "config.json").read_text())
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    return GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra).eval()
