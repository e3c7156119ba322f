"""Builds a `GptOssModel` from a local Hugging Face directory, MXFP4 or dequantized experts alike."""

from __future__ import annotations

import torch
from tqdm import tqdm

from pdflash.target.checkpoint import Checkpoint
from pdflash.target.gpt_oss import GptOssLayerWeights, GptOssModel
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_experts import GptOssExpertProvider, ResidentGptOssExperts


def build_gpt_oss(
    checkpoint: Checkpoint,
    config: GptOssConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    experts: GptOssExpertProvider | None,
    progress: bool,
) -> GptOssModel:
    """Non-expert weights loaded to `device`; experts resident (as stored) unless `experts` is given."""

    def load(name: str, *shape: int) -> torch.Tensor:
        return checkpoint.load(name, shape, dtype).to(device)

    cfg = config
    H, D = cfg.hidden_size, cfg.head_dim
    sizes = {"q_proj": cfg.num_heads * D, "k_proj": cfg.num_kv_heads * D, "v_proj": cfg.num_kv_heads * D}
    layers = []
    for i in tqdm(range(cfg.num_layers), desc="loading target", disable=not progress):
        p = f"model.layers.{i}."
        bias = cfg.attention_bias
        layers.append(
            GptOssLayerWeights(
                input_norm=load(p + "input_layernorm.weight", H),
                post_attention_norm=load(p + "post_attention_layernorm.weight", H),
                qkv_proj=torch.cat([load(p + f"self_attn.{name}.weight", n, H) for name, n in sizes.items()]),
                qkv_bias=torch.cat([load(p + f"self_attn.{name}.bias", n) for name, n in sizes.items()])
                if bias
                else None,
                o_proj=load(p + "self_attn.o_proj.weight", H, cfg.num_heads * D),
                o_bias=load(p + "self_attn.o_proj.bias", H) if bias else None,
                sinks=load(p + "self_attn.sinks", cfg.num_heads),
                router=load(p + "mlp.router.weight", cfg.num_experts, H),
                router_bias=load(p + "mlp.router.bias", cfg.num_experts),
            )
        )
    embed = load("model.embed_tokens.weight", cfg.vocab_size, H)
    return GptOssModel(
        config,
        embed=embed,
        layers=layers,
        final_norm=load("model.norm.weight", H),
        lm_head=embed if cfg.tie_word_embeddings else load("lm_head.weight", cfg.vocab_size, H),
        experts=experts if experts is not None else ResidentGptOssExperts(checkpoint, config, dtype, device),
    )
