"""The device arena of expert slots: how many a byte budget holds, their tensors, and copies into one.

Owns sizing (a budget in bytes, or a fraction of all experts' bytes, at least `MIN_SLOTS`
slots), the per-slot tensors laid out as the store's `slot_layout` says (Qwen3's
gate/up/down in the compute dtype, gpt-oss's MXFP4 blocks and scales as stored), copying
one host expert into a slot (on CUDA after the forwards that read the slot's previous
expert), and the wave a set of (expert, slot) pairs forms for a layer. Knows nothing of
which expert should be resident or of locks: the cache (`device_cache`) decides and guards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pdflash.kernels.mxfp4 import payload_nbytes
from pdflash.offload.gpt_oss_store import GptOssHostExpert, GptOssHostExpertStore
from pdflash.offload.host_store import HostExpert, HostExpertStore

MIN_SLOTS = 2  # one expert being computed while the next one lands


class SlotArena:
    """`num_slots` expert slots on `device`, each `slot_bytes` device bytes."""

    def __init__(
        self,
        store: HostExpertStore | GptOssHostExpertStore,
        *,
        dtype: torch.dtype,
        device: torch.device,
        expert_cache_bytes: int | None,
        expert_cache_fraction: float | None,
    ) -> None:
        self.store, self.device = store, device
        layout = store.slot_layout(dtype)  # name -> (shape, dtype) of one slot's tensors
        self.slot_bytes = payload_nbytes(*layout.values())
        self.budget_bytes = _budget_bytes(expert_cache_bytes, expert_cache_fraction, len(store.keys) * self.slot_bytes)
        self.num_slots = min(self.budget_bytes // self.slot_bytes, len(store.keys))
        if self.num_slots < MIN_SLOTS:
            raise ValueError(
                f"expert cache budget of {self.budget_bytes} bytes holds {self.num_slots} expert(s) of "
                f"{self.slot_bytes} bytes ({dtype}); the minimum is {MIN_SLOTS} experts = "
                f"{MIN_SLOTS * self.slot_bytes} bytes"
            )
        self.tensors = {  # name -> [S, ...]: Qwen3 gate/up/down; gpt-oss MXFP4 blocks, scales, biases
            name: torch.empty((self.num_slots, *shape), dtype=slot_dtype, device=device)
            for name, (shape, slot_dtype) in layout.items()
        }

    def copy_in(
        self, slot: int, host: HostExpert | GptOssHostExpert, after: Iterable[torch.cuda.Event] = ()
    ) -> torch.cuda.Event | None:
        """Copy `host` into `slot` on the current stream, after the events `after` (CUDA: the event
        that marks the copy done, None elsewhere)."""
        if self.device.type == "cuda":
            lane_stream = torch.cuda.current_stream(self.device)
            for done in after:  # forwards that computed on the slot's previous expert
                lane_stream.wait_event(done)
        for name, tensor in host.tensors().items():
            slot_tensor = self.tensors[name][slot]
            if slot_tensor.dtype != tensor.dtype:
                # carry the stored bytes as they are (asynchronous from pinned memory) and convert on
                # the device: copy_ across devices and dtypes would convert on the host into a pageable
                # temporary first, a synchronous CPU pass over every fetched expert
                tensor = tensor.to(self.device, non_blocking=True)
            slot_tensor.copy_(tensor, non_blocking=True)
        if self.device.type != "cuda":
            return None
        loaded = torch.cuda.Event()
        loaded.record(torch.cuda.current_stream(self.device))
        return loaded

    def wave(self, num_experts: int, experts: Sequence[int], slots: Sequence[int]) -> Any:
        """The store's wave over the arena in which expert `experts[i]` sits in slot `slots[i]`."""
        slot_of_expert = torch.full((num_experts,), -1, dtype=torch.int64)  # [E]
        slot_of_expert[list(experts)] = torch.tensor(list(slots))
        return self.store.wave(slot_of_expert.to(self.device), self.tensors)


def _budget_bytes(expert_cache_bytes: int | None, expert_cache_fraction: float | None, all_expert_bytes: int) -> int:
    if (expert_cache_bytes is None) == (expert_cache_fraction is None):
        raise ValueError(
            f"give exactly one of expert_cache_bytes or expert_cache_fraction; got "
            f"expert_cache_bytes={expert_cache_bytes}, expert_cache_fraction={expert_cache_fraction}"
        )
    if expert_cache_fraction is not None:
        if not 0.0 < expert_cache_fraction <= 1.0:
            raise ValueError(f"expert_cache_fraction must be in (0, 1], got {expert_cache_fraction}")
        return int(expert_cache_fraction * all_expert_bytes)
    if expert_cache_bytes is None or expert_cache_bytes < 0:
        raise ValueError(f"expert_cache_bytes must be >= 0, got {expert_cache_bytes}")
    return int(expert_cache_bytes)
