"""Builds a target model from a local Hugging Face directory (config, weights, tokenizer).

Qwen3-MoE is built here; gpt-oss in `gpt_oss_loader` (chosen by the config's family).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, cast

import attrs
import torch
from tqdm import tqdm

from pdflash.target import gpt_oss_layout
from pdflash.target.checkpoint import Checkpoint, expert_byte_map, expert_shapes, expert_tensor_name
from pdflash.target.config import ModelConfig, load_model_config
from pdflash.target.experts import ExpertKey, ExpertProvider, ResidentExperts
from pdflash.target.gpt_oss import GptOssModel
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_experts import GptOssExpertProvider
from pdflash.target.gpt_oss_loader import build_gpt_oss
from pdflash.target.model import AttentionWeights, LayerWeights, Qwen3MoeModel
from pdflash.target.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


TargetModel: TypeAlias = Qwen3MoeModel | GptOssModel  # a target family's model: the same forward and outputs


@attrs.frozen(kw_only=True)
class LoadedTarget:
    model: TargetModel
    tokenizer: TextTokenizer | None  # None when the directory has no tokenizer.json
    checkpoint: Checkpoint
    expert_nbytes: dict[ExpertKey, int]  # (layer, expert) -> payload bytes as stored


ExpertsFactory = Callable[
    [Checkpoint, ModelConfig | GptOssConfig, torch.dtype, torch.device], ExpertProvider | GptOssExpertProvider
]


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on the CPU by default, bfloat16 on an accelerator that supports it."""
    if name is None:
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_target(
    directory: Path | str,
    *,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    experts: ExpertsFactory | None = None,
    progress: bool = False,
) -> LoadedTarget:
    """Load config, non-expert weights and all experts resident, unless `experts` is given: then
    it builds the expert provider from the same parsed config and checkpoint headers."""
    directory = Path(directory)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    config = load_model_config(directory / "config.json")
    checkpoint = Checkpoint(directory)
    provider = experts(checkpoint, config, torch_dtype, device) if experts is not None else None
    tokenizer = TextTokenizer(directory, config.vocab_size) if (directory / "tokenizer.json").is_file() else None
    if isinstance(config, GptOssConfig):
        gpt_oss = build_gpt_oss(
            checkpoint,
            config,
            dtype=torch_dtype,
            device=device,
            experts=cast(GptOssExpertProvider | None, provider),
            progress=progress,
        )
        byte_map = gpt_oss_layout.expert_byte_map(checkpoint, config)
        return LoadedTarget(model=gpt_oss, tokenizer=tokenizer, checkpoint=checkpoint, expert_nbytes=byte_map)

    def load(name: str, *shape: int) -> torch.Tensor:
        return checkpoint.load(name, shape, torch_dtype).to(device)

    cfg = config
    H, D = cfg.hidden_size, cfg.head_dim
    layers: list[LayerWeights] = []
    stacks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # MoE layer -> gate, up, down
    for i in tqdm(range(cfg.num_layers), desc="loading target", disable=not progress):
        p = f"model.layers.{i}."
        bias = lambda name, n, p=p: load(p + f"self_attn.{name}.bias", n)  # only with attention_bias
        qkv_sizes = {"q_proj": cfg.num_heads * D, "k_proj": cfg.num_kv_heads * D, "v_proj": cfg.num_kv_heads * D}
        attention = AttentionWeights(
            qkv_proj=torch.cat([load(p + f"self_attn.{name}.weight", n, H) for name, n in qkv_sizes.items()]),
            o_proj=load(p + "self_attn.o_proj.weight", H, cfg.num_heads * D),
            q_norm=load(p + "self_attn.q_norm.weight", D),
            k_norm=load(p + "self_attn.k_norm.weight", D),
            qkv_bias=torch.cat([bias(name, n) for name, n in qkv_sizes.items()]) if cfg.attention_bias else None,
            o_bias=bias("o_proj", H) if cfg.attention_bias else None,
        )
        router = dense = None
        if cfg.moe_layers[i]:
            router = load(p + "mlp.gate.weight", cfg.num_experts, H)
            if experts is None:
                gate, up, down = (
                    torch.stack([load(expert_tensor_name(i, e, proj), *shape) for e in range(cfg.num_experts)])
                    for proj, shape in expert_shapes(cfg).items()
                )
                stacks[i] = (gate, up, down)
        else:
            inter = cfg.dense_intermediate_size
            dense = (
                load(p + "mlp.gate_proj.weight", inter, H),
                load(p + "mlp.up_proj.weight", inter, H),
                load(p + "mlp.down_proj.weight", H, inter),
            )
        layers.append(
            LayerWeights(
                input_norm=load(p + "input_layernorm.weight", H),
                post_attention_norm=load(p + "post_attention_layernorm.weight", H),
                attention=attention,
                router=router,
                dense=dense,
            )
        )
    embed = load("model.embed_tokens.weight", cfg.vocab_size, H)
    lm_head = embed if cfg.tie_word_embeddings else load("lm_head.weight", cfg.vocab_size, H)
    model = Qwen3MoeModel(
        config,
        embed=embed,
        layers=layers,
        final_norm=load("model.norm.weight", H),
        lm_head=lm_head,
        experts=cast(ExpertProvider, provider) if provider is not None else ResidentExperts(stacks),
    )
    return LoadedTarget(
        model=model, tokenizer=tokenizer, checkpoint=checkpoint, expert_nbytes=expert_byte_map(checkpoint, config)
    )
