"""The host tier for gpt-oss: each expert's share of its layer's stacked tensors, memory-mapped as stored.

MXFP4 experts stay MXFP4 here, on the link and in the device arena: an expert is its slice of
the gate_up / down blocks and scales and of the two biases (the byte map counts exactly these
bytes). Dequantized checkpoints are served the same way, their weights turned [out, in] as
views. Owns the per-expert views, their first-use finiteness check and the arena slot layout
(`host_store.MappedExperts` does the mapping, the check-once and the pinning); must not know
about slots, budgets or eviction.
"""

from __future__ import annotations

import attrs
import torch

from pdflash.kernels.mxfp4 import TensorSpec
from pdflash.offload.host_store import MappedExperts
from pdflash.target.checkpoint import Checkpoint, TensorInfo
from pdflash.target.experts import ExpertKey
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_experts import GptOssExpertWave, wave_tensors
from pdflash.target.gpt_oss_layout import check_finite, expert_prefix, stacked_infos


@attrs.frozen(kw_only=True)
class GptOssHostExpert:
    stored: dict[str, torch.Tensor]  # wave tensor name -> this expert's tensor as stored (uint8 or float)
    nbytes: int  # payload bytes as stored (the byte map's entry)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.stored


class GptOssHostExpertStore(MappedExperts[GptOssHostExpert]):
    """gpt-oss experts by (layer, expert), memory-mapped (and pinned on request)."""

    def __init__(self, checkpoint: Checkpoint, config: GptOssConfig, *, pin: bool = False) -> None:
        super().__init__(checkpoint, [(layer, e) for layer in config.moe_layer_ids for e in range(config.num_experts)])
        self._names: dict[tuple[int, str], str] = {}  # (layer, wave tensor name) -> stored tensor name
        for layer in config.moe_layer_ids:
            infos = stacked_infos(checkpoint, config, layer)
            stacks = {suffix: self._files.view(info) for suffix, info in infos.items()}
            for wave_name, suffix in _wave_names(infos).items():
                self._names[(layer, wave_name)] = expert_prefix(layer) + suffix
            for e in range(config.num_experts):
                stored = wave_tensors({suffix: stack[e] for suffix, stack in stacks.items()}, dtype=None)
                nbytes = sum(stack[e].nbytes for stack in stacks.values())
                self._experts[(layer, e)] = GptOssHostExpert(stored=stored, nbytes=nbytes)
        if pin:
            self._pin(_pinned)

    def _check(self, key: ExpertKey, expert: GptOssHostExpert) -> None:
        """No NaN/inf weights, no NaN scale (the error names the tensor)."""
        for name, tensor in expert.stored.items():
            stored = self._names[(key[0], name)]
            check_finite(tensor, stored, self.checkpoint.tensors[stored])

    def slot_layout(self, dtype: torch.dtype) -> dict[str, TensorSpec]:
        """One arena slot: blocks and scales stay uint8, dense weights and biases take `dtype`."""
        first = self._experts[self.keys[0]].stored
        return {name: (tuple(t.shape), t.dtype if t.dtype == torch.uint8 else dtype) for name, t in first.items()}

    def wave(self, slot_of_expert: torch.Tensor, arena: dict[str, torch.Tensor]) -> GptOssExpertWave:
        return GptOssExpertWave.from_tensors(slot_of_expert, arena)


def _pinned(expert: GptOssHostExpert) -> GptOssHostExpert:
    return attrs.evolve(expert, stored={name: t.contiguous().pin_memory() for name, t in expert.stored.items()})


def _wave_names(infos: dict[str, TensorInfo]) -> dict[str, str]:
    """Wave tensor name -> stored suffix (the inverse of `wave_tensors`' renaming)."""
    if "gate_up_proj_blocks" in infos:
        return {
            "gate_up": "gate_up_proj_blocks",
            "gate_up_scales": "gate_up_proj_scales",
            "gate_up_bias": "gate_up_proj_bias",
            "down": "down_proj_blocks",
            "down_scales": "down_proj_scales",
            "down_bias": "down_proj_bias",
        }
    return {
        "gate_up": "gate_up_proj",
        "gate_up_bias": "gate_up_proj_bias",
        "down": "down_proj",
        "down_bias": "down_proj_bias",
    }
