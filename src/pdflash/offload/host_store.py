"""The host tier: every expert's weights as zero-copy views of the memory-mapped safetensors files.

Owns reading expert tensors from disk (each tensor is `torch.frombuffer` over a private
mmap of its file, at the byte range the checkpoint's one header parse recorded, so nothing
is read until a fetch touches it), optional pinned host copies for asynchronous copies on
CUDA, and the check that an expert's bytes are finite before they reach the device.
`MappedExperts` (experts by key, each checked once, pinned on request) is what the Qwen3
store here and the gpt-oss store (`gpt_oss_store`) share. It must not know about slots,
budgets or eviction.
"""

from __future__ import annotations

import abc
import mmap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import attrs
import torch

from pdflash.errors import CheckpointError
from pdflash.kernels.mxfp4 import TensorSpec
from pdflash.target.checkpoint import EXPERT_PROJECTIONS, Checkpoint, TensorInfo, expert_shapes, expert_tensor_name
from pdflash.target.config import ModelConfig
from pdflash.target.experts import ExpertKey, ExpertWave


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...  # payload bytes as stored (the byte map's entry)


E = TypeVar("E", bound=_Sized)


class MappedFiles:
    """Private (copy-on-write) maps of a checkpoint's safetensors files, each opened once, and
    zero-copy tensor views into them at the byte ranges the header parse recorded."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}  # file -> its private map

    def view(self, info: TensorInfo) -> torch.Tensor:
        if info.file not in self._maps:
            self._maps[info.file] = _map_file(info.file)
        mapped = self._maps[info.file]
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.start)  # [nbytes] zero-copy
        if info.start % info.dtype.itemsize:
            raw = raw.clone()  # misaligned for its dtype: an aligned private copy
        return raw.view(info.dtype).view(info.shape)


class MappedExperts(abc.ABC, Generic[E]):
    """What both host stores share: experts by (layer, expert) as views of the mapped files, each
    checked on its first fetch (once, under a lock), and pinned host copies on request."""

    def __init__(self, checkpoint: Checkpoint, keys: list[ExpertKey]) -> None:
        self.checkpoint, self.keys = checkpoint, keys
        self.pinned = 0  # experts held in pinned host memory
        self._files = MappedFiles()
        self._experts: dict[ExpertKey, E] = {}
        self._verified: set[ExpertKey] = set()
        self._verify_lock = threading.Lock()

    def expert(self, key: ExpertKey) -> E:
        """The tensors of `key`, checked on first use (`_check`'s error names the tensor)."""
        expert = self._experts.get(key)
        if expert is None:
            raise KeyError(f"expert {key} is not in this checkpoint (MoE layers x experts: {len(self.keys)} keys)")
        with self._verify_lock:
            if key not in self._verified:
                self._check(key, expert)
                self._verified.add(key)
        return expert

    def __contains__(self, key: object) -> bool:
        return key in self._experts

    def nbytes(self, key: ExpertKey) -> int:
        return self._experts[key].nbytes

    @abc.abstractmethod
    def _check(self, key: ExpertKey, expert: E) -> None:
        """Raise CheckpointError if `expert`'s stored bytes are not usable (NaN, inf); each store's format says how."""

    def _pin(self, pinned_copy: Callable[[E], E]) -> None:
        """Replace each expert by its copy in pinned host memory, in order; if pinning fails, warn
        and keep the rest memory-mapped."""
        for key in self.keys:
            try:
                self._experts[key] = pinned_copy(self._experts[key])
            except RuntimeError as exc:
                warnings.warn(
                    f"pinning host memory failed after {self.pinned} of {len(self.keys)} experts ({exc}); "
                    f"the rest are copied from pageable memory-mapped pages (synchronous, slower)",
                    RuntimeWarning,
                    stacklevel=3,  # the caller of the store's constructor
                )
                break
            self.pinned += 1


@attrs.frozen(kw_only=True)
class HostExpert:
    """One expert's weights on the host, in the dtype stored in the checkpoint."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    nbytes: int  # payload bytes as stored (the byte map's entry)

    def tensors(self) -> dict[str, torch.Tensor]:
        """By the names of the device arena's slot tensors (`HostExpertStore.slot_layout`)."""
        return {"gate": self.gate, "up": self.up, "down": self.down}


class HostExpertStore(MappedExperts[HostExpert]):
    """Expert weights of one checkpoint, by (layer, expert), memory-mapped (and pinned on request)."""

    def __init__(self, checkpoint: Checkpoint, config: ModelConfig, *, pin: bool = False) -> None:
        super().__init__(checkpoint, [(layer, e) for layer in config.moe_layer_ids for e in range(config.num_experts)])
        self.shapes = expert_shapes(config)
        self._experts = {key: self._map_expert(key) for key in self.keys}
        if pin:
            self._pin(_pinned)

    def _check(self, key: ExpertKey, expert: HostExpert) -> None:
        """Finite weights (the CheckpointError names file and tensor)."""
        for proj, tensor in zip(EXPERT_PROJECTIONS, (expert.gate, expert.up, expert.down)):
            if not torch.isfinite(tensor).all():
                name = expert_tensor_name(*key, proj)
                raise CheckpointError(
                    f"{self.checkpoint.tensors[name].file}: tensor {name!r} contains NaN or infinite values"
                )

    def slot_layout(self, dtype: torch.dtype) -> dict[str, TensorSpec]:
        """Shape and dtype of each tensor of one device-arena slot: the three projections in `dtype`."""
        return {
            "gate": (self.shapes["gate_proj"], dtype),
            "up": (self.shapes["up_proj"], dtype),
            "down": (self.shapes["down_proj"], dtype),
        }

    def wave(self, slot_of_expert: torch.Tensor, arena: dict[str, torch.Tensor]) -> ExpertWave:
        return ExpertWave(slot_of_expert=slot_of_expert, gate=arena["gate"], up=arena["up"], down=arena["down"])

    def _map_expert(self, key: ExpertKey) -> HostExpert:
        tensors = [
            self._files.view(self.checkpoint.info(expert_tensor_name(*key, proj), self.shapes[proj]))
            for proj in EXPERT_PROJECTIONS
        ]
        return HostExpert(gate=tensors[0], up=tensors[1], down=tensors[2], nbytes=sum(t.nbytes for t in tensors))


def _pinned(expert: HostExpert) -> HostExpert:
    gate, up, down = (t.pin_memory() for t in (expert.gate, expert.up, expert.down))
    return attrs.evolve(expert, gate=gate, up=up, down=down)


def _map_file(file: Path) -> mmap.mmap:
    """A private (copy-on-write) map of a safetensors file."""
    try:
        with open(file, "rb") as handle:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot map safetensors file ({exc})") from exc
