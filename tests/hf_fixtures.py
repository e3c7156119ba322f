"""Tiny random Qwen3-MoE checkpoints written by Hugging Face `transformers` (the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

HF_CONFIGS = {
    "gqa4_untied_nonorm": dict(
        num_attention_heads=8, num_key_value_heads=2, norm_topk_prob=False, tie_word_embeddings=False
    ),
    "kv1_tied_norm": dict(num_attention_heads=4, num_key_value_heads=1, norm_topk_prob=True, tie_word_embeddings=True),
    "dense_mixed_yarn": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        mlp_only_layers=[1],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def write_hf_checkpoint(directory: Path, name: str, seed: int = 0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        **HF_CONFIGS[name],
    )
    model = Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory
