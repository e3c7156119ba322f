"""Loading a target whose experts stay in the host store: the offloaded counterpart of `load_target`."""

from __future__ import annotations

from pathlib import Path

import torch

from pdflash.offload.device_cache import OffloadedExperts
from pdflash.offload.gpt_oss_store import GptOssHostExpertStore
from pdflash.offload.host_store import HostExpertStore
from pdflash.target.checkpoint import Checkpoint
from pdflash.target.config import load_model_config
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.loader import LoadedTarget, load_target, resolve_dtype


def load_offloaded_target(
    directory: Path | str,
    *,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    pin_host: bool | None = None,
    progress: bool = False,
    **cache: object,
) -> LoadedTarget:
    """Non-expert weights resident, experts served by an `OffloadedExperts` (at `.model.experts`).

    `cache` are `OffloadedExperts` keywords (expert_cache_bytes or expert_cache_fraction,
    policy, link_gbps, link_latency_s). `pin_host` defaults to pinning on CUDA only.
    """
    directory = Path(directory)
    device = torch.device(device)
    config = load_model_config(directory / "config.json")
    pin = device.type == "cuda" if pin_host is None else pin_host
    store: HostExpertStore | GptOssHostExpertStore = (
        GptOssHostExpertStore(Checkpoint(directory), config, pin=pin)
        if isinstance(config, GptOssConfig)
        else HostExpertStore(Checkpoint(directory), config, pin=pin)
    )
    experts = OffloadedExperts(store, config, dtype=resolve_dtype(dtype, device), device=device, **cache)
    return load_target(directory, dtype=dtype, device=device, experts=experts, progress=progress)
