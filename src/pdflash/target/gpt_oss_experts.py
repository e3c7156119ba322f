"""gpt-oss experts behind the provider seam: the wave they come in, and the resident provider.

A wave holds some experts of one layer in slots, either as stored in MXFP4 (uint8 blocks and
E8M0 scales, dequantized only when computed) or dense; the biases ride along. The offloaded
device cache serves the same waves from its arena (`offload.gpt_oss_store`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs
import torch

from pdflash.target.checkpoint import Checkpoint
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_layout import check_finite, expert_prefix, stacked_infos

WAVE_TENSORS = ("gate_up", "gate_up_scales", "gate_up_bias", "down", "down_scales", "down_bias")


@attrs.frozen(kw_only=True)
class GptOssExpertWave:
    slot_of_expert: torch.Tensor  # [E] int64: slot holding expert e in this wave, -1 if absent
    gate_up: torch.Tensor  # [S, 2I, H] dense or [S, 2I, H/32, 16] uint8 blocks; rows alternate gate, up
    gate_up_scales: torch.Tensor | None  # [S, 2I, H/32] uint8 E8M0, None when dense
    gate_up_bias: torch.Tensor  # [S, 2I]
    down: torch.Tensor  # [S, H, I] dense or [S, H, I/32, 16] uint8 blocks
    down_scales: torch.Tensor | None  # [S, H, I/32] uint8, None when dense
    down_bias: torch.Tensor  # [S, H]

    @classmethod
    def from_tensors(cls, slot_of_expert: torch.Tensor, tensors: dict[str, torch.Tensor]) -> GptOssExpertWave:
        return cls(
            slot_of_expert=slot_of_expert,
            gate_up=tensors["gate_up"],
            gate_up_scales=tensors.get("gate_up_scales"),
            gate_up_bias=tensors["gate_up_bias"],
            down=tensors["down"],
            down_scales=tensors.get("down_scales"),
            down_bias=tensors["down_bias"],
        )


class GptOssExpertProvider(Protocol):
    def waves(self, layer: int, union: list[int]) -> Iterator[GptOssExpertWave]:
        """Waves that together cover every expert id in `union` of layer `layer`."""
        ...


def wave_tensors(stored: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Wave tensors from a layer's (or one expert's) stored ones: MXFP4 kept, dense moved to [.., out, in].

    `dtype` applies to dense weights and biases only (None keeps them as stored); blocks and
    scales stay uint8.
    """

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if dtype is None else t.to(dtype)

    if "gate_up_proj_blocks" in stored:
        return {
            "gate_up": stored["gate_up_proj_blocks"],
            "gate_up_scales": stored["gate_up_proj_scales"],
            "gate_up_bias": cast(stored["gate_up_proj_bias"]),
            "down": stored["down_proj_blocks"],
            "down_scales": stored["down_proj_scales"],
            "down_bias": cast(stored["down_proj_bias"]),
        }
    return {
        "gate_up": cast(stored["gate_up_proj"].transpose(-1, -2)),  # [.., 2I, H]
        "gate_up_bias": cast(stored["gate_up_proj_bias"]),
        "down": cast(stored["down_proj"].transpose(-1, -2)),  # [.., H, I]
        "down_bias": cast(stored["down_proj_bias"]),
    }


class ResidentGptOssExperts:
    """Every expert of every layer in memory as stored (MXFP4 stays packed): one wave per layer."""

    def __init__(self, checkpoint: Checkpoint, config: GptOssConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.stacks: dict[int, dict[str, torch.Tensor]] = {}
        for layer in config.moe_layer_ids:
            stored = {}
            for suffix, info in stacked_infos(checkpoint, config, layer).items():
                name = expert_prefix(layer) + suffix
                stored[suffix] = checkpoint.load(name, info.shape, info.dtype)
                check_finite(stored[suffix], name, info)
            stored = {suffix: t.to(device) for suffix, t in stored.items()}
            self.stacks[layer] = {name: t.contiguous() for name, t in wave_tensors(stored, dtype).items()}
        self._identity = torch.arange(config.num_experts, device=device)

    def waves(self, layer: int, union: list[int]) -> Iterator[GptOssExpertWave]:
        yield GptOssExpertWave.from_tensors(self._identity, self.stacks[layer])
