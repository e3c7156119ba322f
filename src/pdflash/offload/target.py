"""Loading a target whose experts stay in the host store: the offloaded counterpart of `load_target`."""

from __future__ import annotations

from pathlib import Path

import torch

from pdflash.offload.device_cache import OffloadedExperts
from pdflash.offload.gpt_oss_store import GptOssHostExpertStore
from pdflash.offload.host_store import HostExpertStore
from pdflash.target.checkpoint import Checkpoint
from pdflash.target.config import ModelConfig
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.loader import LoadedTarget, load_target


def load_offloaded_target(  # load_target's parameters, experts replaced by the cache's options
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
    policy, link_gbps, link_latency_s). `pin_host` defaults to pinning on CUDA only. The host
    store follows the family: gpt-oss experts stay as stored (MXFP4 packed).
    """

    def experts(
        checkpoint: Checkpoint, config: ModelConfig | GptOssConfig, torch_dtype: torch.dtype, device: torch.device
    ) -> OffloadedExperts:
        pin = device.type == "cuda" if pin_host is None else pin_host
        store: HostExpertStore | GptOssHostExpertStore = (
            GptOssHostExpertStore(checkpoint, config, pin=pin)
            if isinstance(config, GptOssConfig)
            else HostExpertStore(checkpoint, config, pin=pin)
        )
        return OffloadedExperts(store, config, dtype=torch_dtype, device=device, **cache)  # type: ignore[arg-type]

    return load_target(directory, dtype=dtype, device=device, experts=experts, progress=progress)
