"""`pdflash bench --calibrate`: per-forward costs of this machine, as the simulator's CostModel.

Owns timing the speculator's batched rounds (prefill, drafter, route projection, verify)
at several batch sizes on the offloaded target with every expert resident and no emulated
link (so copies cost nothing and what is left is compute), the engine's per-step
bookkeeping from a short closed-loop run, and the linear fits. Must not simulate.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import anyio

from pdflash.bench.costs import CalibratedCosts, fit_linear
from pdflash.engine.async_engine import AsyncEngine
from pdflash.offload import load_offloaded_target
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator

BATCHES = (1, 2, 4, 8, 16, 32)
T = TypeVar("T")


def _timed(fn: Callable[..., T], *args: object) -> tuple[float, T]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def calibrate(
    target: Path, drafter: Path, pool: Sequence[list[int]], *, rounds: int = 3, progress=lambda _: None
) -> CalibratedCosts:
    loaded = load_offloaded_target(target, expert_cache_fraction=1.0)
    provider = loaded.model.experts
    try:
        draft_model = load_drafter(drafter, loaded.model)
        specs = {
            spec: Speculator(
                loaded.model,
                draft_model if spec else None,
                expert_nbytes=loaded.expert_nbytes,
                projector="router",
                resident=provider.resident,
            )
            for spec in (False, True)
        }
        prefill, drafts, projections, verifies = [], [], [], []
        for _ in range(2):  # warm-up: every expert lands in the cache, kernels are loaded
            for spec in specs.values():
                _rounds(spec, pool[:8], 2, [], [], [], [])
        for n in BATCHES:
            for spec in specs.values():
                _rounds(spec, [pool[i % len(pool)] for i in range(n)], rounds, prefill, drafts, projections, verifies)
            progress(f"calibrate batch {n}")
        step = _step_overhead(target, pool)
    finally:
        provider.close()
    return CalibratedCosts(
        prefill=fit_linear([[t] for t, _ in prefill], [s for _, s in prefill]),
        drafter=fit_linear([[n] for n, _ in drafts], [s for _, s in drafts]),
        projection=fit_linear([[t] for t, _ in projections], [s for _, s in projections]),
        verify=fit_linear([[t, e] for t, e, _ in verifies], [s for *_, s in verifies]),
        step=fit_linear([[n] for n, _ in step], [s for _, s in step]),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, torch threads as started",
    )


def _rounds(spec: Speculator, prompts, rounds: int, prefill, drafts, projections, verifies) -> None:
    params = SamplingParams(max_tokens=rounds * spec.block_size + 2)
    seconds, sessions = _timed(spec.begin_sessions, [(p, params) for p in prompts])
    prefill.append((sum(map(len, prompts)), seconds))
    for _ in range(rounds):
        live = [s for s in sessions if not s.finished]
        if not live:
            break
        seconds, results = _timed(spec.draft_rounds, live)
        projection = sum(r.projection_seconds for r in results)
        tokens = sum(r.tokens for r in results)
        projections.append((tokens, projection))
        if spec.drafter is not None:
            drafts.append((len(live), seconds - projection))
        seconds, _ = _timed(spec.verify_rounds, live)
        experts = len(frozenset().union(*(s.last_union for s in live)))
        verifies.append((tokens, experts, seconds))
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
                return (wall - stats.model_seconds) / stats.steps

        samples.append((c, anyio.run(body)))
    return samples


async def _drain(engine: AsyncEngine, prompt: list[int]) -> None:
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=32)):
        pass
