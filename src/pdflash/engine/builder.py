"""Model assembly for the engine: the bundled default, the projector choice and the offloaded branch.

Owns turning checkpoint paths and options into the parts an AsyncEngine serves with: a
Speculator (target and optional DFlash drafter), the tokenizer, and the expert provider
when experts are offloaded. Loading runs on a short-lived thread (`off_thread`), so the
caller's thread never starts torch's OpenMP team (it would slow the lane's forwards).
Must not touch scheduling or serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from pdflash.bundled import default_drafter, default_target
from pdflash.engine.lanes import drafter_has_own_lane, lane_threads, off_thread
from pdflash.measure import BusyClock
from pdflash.spec.drafter import load_drafter
from pdflash.spec.projection import RouteHead, make_projector, route_head_path
from pdflash.spec.speculator import Speculator
from pdflash.spec.step_install import install_steps
from pdflash.target.compiled import BATCH_BUCKETS
from pdflash.target.experts import ExpertKey
from pdflash.target.loader import LoadedTarget, load_target
from pdflash.target.tokenizer import TextTokenizer


class OffloadProvider(Protocol):
    """What the engine asks of an offloaded expert store (pdflash.offload.OffloadedExperts)."""

    budget_bytes: int  # the device cache's byte budget

    @property
    def link_bytes_per_s(self) -> float | None: ...  # emulated, or a real link's measured at start; None: no link
    @property
    def exposed_fetch_s(self) -> float: ...  # seconds forwards have waited on its copies so far

    # one claim per verify of one batched forward: queue route-ahead fetches, claim them; never blocks
    def prefetch_launch(self, unions: list[frozenset[ExpertKey]]) -> list[Any]: ...
    def release(self, claim: Any) -> None: ...  # the claims of one verify's prefetch, once it ran
    def forward_of(self, claims: list[Any]) -> AbstractContextManager[None]: ...  # the forward verifying them
    def resident(self) -> frozenset[ExpertKey]: ...
    def copy_intervals(self) -> list[tuple[float, float]]: ...  # recent (start, end) of its copies
    def watch_busy(self, clock: BusyClock) -> None: ...  # count the time its copies run into `clock`
    def stats(self) -> dict: ...
    def close(self) -> None: ...


@attrs.frozen(kw_only=True)
class EngineParts:
    speculator: Speculator
    tokenizer: TextTokenizer | None
    provider: OffloadProvider | None  # the offloaded expert store, closed by whoever owns the engine


BUILD_OPTIONS = ("block_size", "projector", "dtype", "device", "offload", "progress", "compile")  # build keywords


def build_engine_parts(
    target: Path | str | None = None,
    drafter: Path | str | None = None,
    *,
    block_size: int | None = None,
    projector: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    offload: Mapping[str, Any] | None = None,
    progress: bool = False,
    byte_budgets: bool = False,
    compile: bool = False,
    max_batch: int = BATCH_BUCKETS[-1],
    drafter_lane: str = "auto",
) -> EngineParts:
    """Load a target (no target: the bundled pair) and optionally a DFlash drafter.

    `offload`: keywords of `pdflash.offload.load_offloaded_target` (expert_cache_fraction,
    link_gbps, ...) to serve experts from the host store. `projector` defaults, when its
    coverage is used (offloading or `byte_budgets`), to the trained route head found beside
    the drafter (or beside the bundled drafter for the bundled target, drafting or not), else
    to the router pass; otherwise to the free last-union (docs/speculative.md measures them).
    `compile` runs decode, verify and draft steps of up to `max_batch` sequences as compiled
    static-shape steps, compiled here (warm-up, docs/compile.md); without it every forward is eager.
    `drafter_lane` (EngineConfig's) says whose thread count the drafter's steps are compiled for.
    """
    if target is None:  # the bundled pair
        target, drafter = default_target(), drafter or default_drafter(default_target())
    target = Path(target)
    head_path = route_head_path(drafter or default_drafter(target))
    if projector is None:
        bytes_matter = offload is not None or byte_budgets
        projector = ("route-head" if head_path else "router") if bytes_matter else "last-union"
    provider: OffloadProvider | None = None
    if offload is not None:
        from pdflash.offload import load_offloaded_target

        options = dict(offload)
        loaded: LoadedTarget = off_thread(
            lambda: load_offloaded_target(target, dtype=dtype, device=device, progress=progress, **options)
        )
        provider = loaded.model.experts  # type: ignore[assignment]  # an OffloadedExperts
    else:
        loaded = off_thread(lambda: load_target(target, dtype=dtype, device=device, progress=progress))
    try:
        draft_model = off_thread(lambda: load_drafter(drafter, loaded.model, progress=progress)) if drafter else None
        head = RouteHead.load(head_path, loaded.model.config) if projector == "route-head" and head_path else None
        speculator = Speculator(
            loaded.model,
            draft_model,
            expert_nbytes=loaded.expert_nbytes,
            projector=make_projector(projector, route_head=head),
            block_size=block_size,
            resident=provider.resident if provider is not None else frozenset,
        )
        if compile:  # on a thread of its own, at the lanes' thread counts (AsyncEngine.__aenter__)
            own_lane = draft_model is not None and drafter_has_own_lane(
                drafter_lane,
                device=torch.device(device),
                offloaded=provider is not None,
                threads=torch.get_num_threads(),
            )
            threads = lane_threads(torch.get_num_threads(), drafter=own_lane)
            off_thread(lambda: install_steps(speculator, max_batch=max_batch, threads=threads, progress=progress))
    except BaseException:
        if provider is not None:
            provider.close()
        raise
    return EngineParts(speculator=speculator, tokenizer=loaded.tokenizer, provider=provider)
