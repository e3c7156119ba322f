"""`pdflash bench --calibrate`: per-forward costs of this machine, as the simulator's CostModel.

Owns timing the speculator's batched rounds (prefill, drafter, route projection, verify)
at several batch sizes on the offloaded target with every expert resident and no emulated
link (so copies cost nothing and what is left is compute), the engine's per-step
bookkeeping from a short closed-loop run, and the linear fits. Must not simulate.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, cast

import anyio
import torch

from pdflash.bench.costs import CalibratedCosts, fit_linear
from pdflash.engine.async_engine import AsyncEngine
from pdflash.offload import OffloadedExperts, load_offloaded_target
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.loader import load_target

BATCHES = (1, 2, 4, 8, 16, 32)
REPEATS = 3  # passes over BATCHES; each shape's median is fitted
T = TypeVar("T")


def _timed(fn: Callable[..., T], *args: object) -> tuple[float, T]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


class Samples:
    """Timings per phase, grouped by (drafter?, batch, round) so repeats of one shape reduce to
    their median (other jobs on a shared machine add time; a median resists that)."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[tuple, list[tuple[float, ...]]]] = defaultdict(lambda: defaultdict(list))

    def add(self, phase: str, key: tuple, *features_then_seconds: float) -> None:
        self.groups[phase][key].append(features_then_seconds)

    def fit(self, phase: str) -> tuple[float, ...]:
        medians = [[statistics.median(col) for col in zip(*rows, strict=True)] for rows in self.groups[phase].values()]
        return fit_linear([m[:-1] for m in medians], [m[-1] for m in medians])


def calibrate(
    target: Path, drafter: Path, pool: Sequence[list[int]], *, rounds: int = 3, progress=lambda _: None
) -> CalibratedCosts:
    loaded = load_offloaded_target(target, expert_cache_fraction=1.0)
    provider = cast(OffloadedExperts, loaded.model.experts)
    resident = load_target(target)
    try:
        draft_model = load_drafter(drafter, loaded.model)
        specs = [  # (speculator, phase prefix): offloaded with the router projector, resident without
            (
                Speculator(
                    model.model,
                    draft_model if speculative else None,
                    expert_nbytes=model.expert_nbytes,
                    projector="router" if offloaded else "last-union",
                    resident=provider.resident if offloaded else frozenset,
                ),
                "" if offloaded else "resident_",
            )
            for offloaded, model in ((True, loaded), (False, resident))
            for speculative in (False, True)
        ]
        for _ in range(2):  # warm-up: every expert lands in the cache, kernels are loaded
            for spec, prefix in specs:
                _rounds(spec, pool[:8], 2, Samples(), prefix)
        progress("warm-up")
        samples = Samples()
        for _ in range(REPEATS):
            for n in BATCHES:
                for spec, prefix in specs:
                    _rounds(spec, [pool[i % len(pool)] for i in range(n)], rounds, samples, prefix)
                progress(f"calibrate batch {n}")
        step = _step_overhead(target, pool)
    finally:
        provider.close()
    return CalibratedCosts(
        prefill=samples.fit("prefill"),
        drafter=samples.fit("drafter"),
        projection=samples.fit("projection"),
        verify=samples.fit("verify"),
        resident_prefill=samples.fit("resident_prefill"),
        resident_verify=samples.fit("resident_verify"),
        step=fit_linear([[n] for n, _ in step], [s for _, s in step]),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s)",
    )


def _rounds(spec: Speculator, prompts, rounds: int, samples: Samples, prefix: str) -> None:
    """Prefill `prompts` and run `rounds` batched rounds, timing each phase; the drafter and the
    router projection are only sampled on the offloaded target (prefix ""), where the engine uses them."""
    params = SamplingParams(max_tokens=rounds * spec.block_size + 2)
    speculative = spec.drafter is not None
    seconds, sessions = _timed(spec.begin_sessions, [(p, params) for p in prompts])
    samples.add(prefix + "prefill", (speculative, len(prompts)), sum(map(len, prompts)), len(prompts), seconds)
    context = sum(map(len, prompts))  # tap features the drafter has not seen yet
    for index in range(rounds):
        live = [s for s in sessions if not s.finished]
        if not live:
            break
        key = (speculative, len(prompts), index)
        seconds, results = _timed(spec.draft_rounds, live)
        projection = sum(r.projection_s for r in results)
        tokens = sum(r.tokens for r in results)
        if not prefix:
            samples.add("projection", key, tokens, len(live), projection)
        if speculative and not prefix:
            samples.add("drafter", key, len(live), context, seconds - projection)
        seconds, verified = _timed(spec.verify_rounds, live)
        experts = len(frozenset().union(*(s.last_union for s in live)))
        samples.add(prefix + "verify", key, tokens, experts, len(live), seconds)
        context = sum(len(v.accepted_ids) for v in verified)
    for s in sessions:
        spec.release(s)


def _step_overhead(target: Path, pool) -> list[tuple[int, float]]:
    """(live sequences, engine seconds per step outside model forwards), resident AR engine."""
    samples = []
    for c in (1, 4, 16):
        engine = AsyncEngine.from_pretrained(target, None, max_num_seqs=c)

        async def body(engine=engine, c=c) -> float:
            async with engine:
                started = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(c):
                        tg.start_soon(_drain, engine, pool[i % len(pool)])
                wall = time.perf_counter() - started
                stats = engine.stats()
                launches = sum(stats.verify_batch_sizes.values())  # one step: a batched verify (prefills aside)
                return (wall - stats.model_s) / launches

        samples.append((c, anyio.run(body)))
    return samples


async def _drain(engine: AsyncEngine, prompt: list[int]) -> None:
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=32)):
        pass
