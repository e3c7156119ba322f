"""The gpt-oss expert layout on disk: tensor names and shapes of both forms, and the byte map.

gpt-oss stores each layer's experts stacked, one tensor per kind:
  MXFP4:       gate_up_proj_blocks [E, 2I, H/32, 16] uint8, gate_up_proj_scales [E, 2I, H/32] uint8 (E8M0),
               down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32], and the two biases;
  dequantized: gate_up_proj [E, H, 2I], down_proj [E, I, H], and the two biases.
Biases: gate_up_proj_bias [E, 2I], down_proj_bias [E, H]. Rows of gate_up alternate gate, up.

Owns which tensors an expert is made of and their checks against the safetensors headers
(a missing tensor, a wrong shape or a wrong dtype fails naming it); knows no model math.
"""

from __future__ import annotations

import torch

from pdflash.errors import CheckpointError
from pdflash.kernels.mxfp4 import BLOCK_SIZE, mxfp4_expert_nbytes
from pdflash.target.checkpoint import Checkpoint, TensorInfo
from pdflash.target.experts import ExpertKey
from pdflash.target.gpt_oss_config import GptOssConfig


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def stacked_shapes(config: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Stored name suffix -> shape of the stacked tensor, for the config's form."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    biases: dict[str, tuple[int, ...]] = {"gate_up_proj_bias": (E, 2 * I), "down_proj_bias": (E, H)}
    if config.quant_method == "mxfp4":
        for name, size in (("hidden_size", H), ("intermediate_size", I)):
            if size % BLOCK_SIZE:
                raise CheckpointError(f"gpt_oss MXFP4 needs {name} a multiple of {BLOCK_SIZE}; got {size}")
        return {
            "gate_up_proj_blocks": (E, 2 * I, H // BLOCK_SIZE, 16),
            "gate_up_proj_scales": (E, 2 * I, H // BLOCK_SIZE),
            "down_proj_blocks": (E, H, I // BLOCK_SIZE, 16),
            "down_proj_scales": (E, H, I // BLOCK_SIZE),
        } | biases
    return {"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H)} | biases


def stacked_infos(checkpoint: Checkpoint, config: GptOssConfig, layer: int) -> dict[str, TensorInfo]:
    """Headers of one layer's stacked expert tensors, each checked for presence, shape and dtype."""
    infos = {}
    for suffix, shape in stacked_shapes(config).items():
        name = expert_prefix(layer) + suffix
        info = checkpoint.info(name, shape)
        packed = suffix.endswith(("_blocks", "_scales"))
        if packed and info.dtype != torch.uint8:
            raise CheckpointError(f"{info.file}: tensor {name!r} must be uint8 (MXFP4 {suffix[-6:]}); got {info.dtype}")
        if not packed and not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.file}: tensor {name!r} must be floating point; got {info.dtype}")
        infos[suffix] = info
    return infos


def expert_byte_map(checkpoint: Checkpoint, config: GptOssConfig) -> dict[ExpertKey, int]:
    """expert_nbytes[(layer, expert)]: the expert's share of each stacked tensor, as stored."""
    byte_map: dict[ExpertKey, int] = {}
    for layer in config.moe_layer_ids:
        per_expert = sum(
            info.nbytes // config.num_experts for info in stacked_infos(checkpoint, config, layer).values()
        )
        byte_map |= {(layer, e): per_expert for e in range(config.num_experts)}
    return byte_map


def published_expert_nbytes(hidden_size: int, intermediate_size: int) -> int:
    """Bytes of one expert of a published (MXFP4, bf16 biases) gpt-oss checkpoint, from its config alone.

    gpt-oss-20b and gpt-oss-120b (hidden 2880, intermediate 2880): 13,236,480 bytes.
    """
    return mxfp4_expert_nbytes(hidden_size, intermediate_size, torch.bfloat16)


def config_byte_map(config: GptOssConfig) -> dict[ExpertKey, int]:
    """The byte map of a published (MXFP4) gpt-oss checkpoint from its config alone, for profiles
    and simulations without the weights: every expert of every layer is `published_expert_nbytes`."""
    nbytes = published_expert_nbytes(config.hidden_size, config.moe_intermediate_size)
    return {(layer, e): nbytes for layer in config.moe_layer_ids for e in range(config.num_experts)}


def check_finite(tensor: torch.Tensor, name: str, info: TensorInfo) -> None:
    """Raise naming `name` if a float tensor holds NaN/inf, or an E8M0 scale tensor the NaN code 255."""
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise CheckpointError(f"{info.file}: tensor {name!r} contains NaN or infinite values")
    if name.endswith("_scales") and bool((tensor == 255).any()):
        raise CheckpointError(f"{info.file}: tensor {name!r} holds the E8M0 scale 255, which means NaN")
