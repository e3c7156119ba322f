"""`pdflash bench`: configurations side by side over the public AsyncEngine API, interleaved.

Owns building one fresh engine per (configuration, point) from the time scale, the
closed-loop clients and the Poisson (open-loop) clients, reading each request's figures
from its RequestOutput.metrics and the engine's and provider's stats, the interleaved
sweep order, routing recording, and the prompts and link-bound plan the benchmark scripts
share (`prompt_pool`, `bundled_behind_link`). Must not compute metrics (pdflash.bench.metrics) nor
format reports (pdflash.bench.report).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import attrs
import torch

from pdflash.bench.configs import BenchConfig, two_d_budgets
from pdflash.bench.metrics import PointResult, RequestRecord, Traffic, summarise
from pdflash.bench.profiles import TimeScale, get_profile
from pdflash.bench.routing import RoutingRecorder
from pdflash.bench.workload import humaneval_prompts
from pdflash.bundled import default_drafter, default_target
from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.charging import largest_block_union_bytes
from pdflash.sampling import SamplingParams
from pdflash.target.config import ModelConfig
from pdflash.target.tokenizer import TextTokenizer


@attrs.frozen(kw_only=True)
class BenchPlan:
    target: Path
    drafter: Path
    configs: tuple[BenchConfig, ...]
    concurrency: tuple[int, ...]
    max_tokens: int
    min_requests: int  # requests per point at least (clients x requests per client)
    repeats: int  # interleaved repeats per point; the median tokens/s one is reported
    policy: str = "activation"
    device: str = "cpu"  # where the measured engines run (the time scale is measured there too)
    drafter_lane: str = "auto"  # EngineConfig.drafter_lane of every measured engine
    prefill_mode: str = "auto"  # EngineConfig.prefill_mode of every measured engine

    def requests_per_client(self, concurrency: int) -> int:
        return max(1, -(-self.min_requests // concurrency))


@attrs.frozen(kw_only=True)
class EngineRecipe:
    """How to build the engine of each configuration (the same for every point)."""

    scale: TimeScale | None  # None: resident only (B3) or untimed
    block_size: int
    largest_union_bytes: int
    expert_bytes_total: int  # Σ of the byte map
    max_num_seqs: int

    def budgets(self, config: BenchConfig) -> dict:
        if config.scheduling != "fixed":
            return {"scheduling": config.scheduling} if config.offloaded else {}
        assert self.scale is not None, "a 2-D configuration is offloaded: it needs a time scale"
        return two_d_budgets(
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            cache_bytes=int(self.scale.cache_fraction * self.expert_bytes_total),
            largest_union_bytes=self.largest_union_bytes,
        )

    def build(self, plan: BenchPlan, config: BenchConfig) -> AsyncEngine:
        offload = None
        if config.offloaded:
            assert self.scale is not None, "an offloaded configuration needs a time scale"
            offload = {
                "expert_cache_fraction": self.scale.cache_fraction,
                "link_gbps": self.scale.link_gbps,
                "policy": plan.policy,
            }
        return AsyncEngine.from_pretrained(
            plan.target,
            plan.drafter if config.speculative else None,
            device=plan.device,
            offload=offload,
            max_num_seqs=self.max_num_seqs,
            speculation=config.speculation,
            verify_order=config.verify_order,
            projector=config.projector,
            drafter_lane=plan.drafter_lane,
            prefill_mode=plan.prefill_mode,
            **self.budgets(config),
        )


def measure_ar_step_s(target: Path, prompts: Sequence[list[int]], tokens: int = 32) -> float:
    """One autoregressive decode step here: resident target, batch 1, median over prompts of
    (last delta - first delta) / (tokens - 1)."""
    engine = AsyncEngine.from_pretrained(target, None, max_num_seqs=1)
    params = SamplingParams(max_tokens=tokens)
    steps = []

    async def body() -> None:
        async with engine:
            for prompt in prompts:
                records = await one_request(engine, prompt, params)
                if records.tokens > 1:
                    steps.append((records.finished_s - records.first_token_s) / (records.tokens - 1))

    anyio.run(body)
    return statistics.median(steps)


def engine_recipe(plan: BenchPlan, scale: TimeScale | None) -> EngineRecipe:
    """Read the block size and byte map from a probe engine (loaded, never started)."""
    probe = AsyncEngine.from_pretrained(plan.target, plan.drafter)
    spec = probe.speculator
    return EngineRecipe(
        scale=scale,
        block_size=spec.block_size,
        largest_union_bytes=largest_block_union_bytes(spec.expert_nbytes, spec.block_size, spec.target.config.top_k),
        expert_bytes_total=sum(spec.expert_nbytes.values()),
        max_num_seqs=max(plan.concurrency),
    )


def token_routed_bytes(target: Path) -> int:
    """One token's routed expert bytes of `target`: Σ over MoE layers of top-k mean experts."""
    probe = AsyncEngine.from_pretrained(target, None)
    spec = probe.speculator
    cfg = spec.target.config
    per_layer: dict[int, list[int]] = {}
    for (layer, _), nbytes in spec.expert_nbytes.items():
        per_layer.setdefault(layer, []).append(nbytes)
    return round(sum(cfg.top_k * statistics.mean(sizes) for sizes in per_layer.values()))


def prompt_pool(target: Path, count: int) -> list[list[int]]:
    """The first `count` HumanEval headers in `target`'s tokens: what every point's requests send."""
    tokenizer = TextTokenizer(target, ModelConfig.from_file(target / "config.json").vocab_size)
    return [tokenizer.encode(text) for text in humaneval_prompts(count)]


@attrs.frozen(kw_only=True)
class LinkedRun:
    """The bundled pair's configurations behind a profile's time-scaled link, one repeat per point."""

    plan: BenchPlan
    scale: TimeScale  # measured here: this machine's AR step sets the link's rate
    pool: list[list[int]]  # 32 HumanEval headers, tokenized


def bundled_behind_link(
    configs: Sequence[BenchConfig], concurrency: Sequence[int], *, profile: str, max_tokens: int, min_requests: int
) -> LinkedRun:
    """What a benchmark script runs `pdflash bench` points with: the bundled target and drafter,
    the time scale of `profile` measured on this machine (as `pdflash bench` does) and the prompts."""
    target = default_target()
    drafter = default_drafter(target)
    assert drafter is not None, "the bundled target ships its drafter"
    pool = prompt_pool(target, 32)
    scale = TimeScale.for_profile(
        get_profile(profile),
        ar_step_s=measure_ar_step_s(target, pool[:4]),
        token_routed_bytes=token_routed_bytes(target),
    )
    plan = BenchPlan(
        target=target,
        drafter=drafter,
        configs=tuple(configs),
        concurrency=tuple(concurrency),
        max_tokens=max_tokens,
        min_requests=min_requests,
        repeats=1,
    )
    return LinkedRun(plan=plan, scale=scale, pool=pool)


def add_linked_run_options(
    parser: argparse.ArgumentParser, *, configs: str, concurrency: list[int], min_requests: int = 8, threads: int = 1
) -> None:
    """The options of a benchmark script that runs `pdflash bench` points behind a profile's
    link (`linked_run` reads them), with the script's own defaults."""
    parser.add_argument("--configs", default=configs, help=f"offloaded configurations (bench names; default {configs})")
    clients = " ".join(map(str, concurrency))
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=concurrency, help=f"closed-loop clients (default {clients})"
    )
    parser.add_argument("--profile", default="qwen3-30b-a3b@h200-pcie5", help="deployment profile (pdflash bench)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per request (default 48)")
    parser.add_argument(
        "--min-requests", type=int, default=min_requests, help=f"requests per point at least (default {min_requests})"
    )
    parser.add_argument("--torch-threads", type=int, default=threads, help=f"intra-op threads (default {threads})")


def linked_run(args: argparse.Namespace, configs: Sequence[BenchConfig]) -> LinkedRun:
    """`bundled_behind_link` for a script's parsed `add_linked_run_options`, its torch threads set first."""
    torch.set_num_threads(args.torch_threads)
    return bundled_behind_link(
        configs, args.concurrency, profile=args.profile, max_tokens=args.max_tokens, min_requests=args.min_requests
    )


async def one_request(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> RequestRecord:
    """One request through `engine.generate`, its deltas timed as they arrive."""
    arrived = time.perf_counter()
    times, tokens, last = [], [], None
    async for out in engine.generate(prompt, params):
        times.append(time.perf_counter())
        tokens.append(len(out.token_ids))
        last = out
    assert last is not None, "a stream ends with a finished delta"
    m = last.metrics
    coverage = (m.session_stats or {}).get("projection_coverage_bytes") if m.acceptance_lengths else None
    return RequestRecord(
        arrived_s=arrived,
        first_token_s=times[0],
        finished_s=times[-1],
        delta_times_s=tuple(times),
        delta_tokens=tuple(tokens),
        acceptance_lengths=tuple(m.acceptance_lengths),
        admission_wait_s=m.admission_wait_s,
        projection_coverage_bytes=coverage,
    )


def _traffic(engine: AsyncEngine) -> Traffic:
    stats = engine.stats()
    p = stats.provider or {}
    return Traffic(
        expert_bytes_fetched=p.get("expert_bytes_fetched", 0),
        hit_bytes=p.get("hit_bytes", 0),
        miss_bytes=p.get("miss_bytes", 0),
        exposed_fetch_s=p.get("exposed_fetch_s", 0.0),
        model_s=stats.model_s,
        busy_s=stats.busy_s,
        link_busy_s=p.get("link_busy_s", 0.0),
    )


def run_point(
    engine: AsyncEngine,
    config: BenchConfig,
    pool: Sequence[list[int]],
    params: SamplingParams,
    *,
    concurrency: int,
    requests_per_client: int = 1,
    arrivals_s: Sequence[float] | None = None,
    recorder: Callable[[AsyncEngine], None] | None = None,
) -> PointResult:
    """One fresh engine, one point: closed loop (`concurrency` clients) or open loop (`arrivals_s`)."""
    records: list[RequestRecord] = []
    if recorder is not None:
        recorder(engine)

    async def closed(c: int) -> None:
        for r in range(requests_per_client):
            records.append(await one_request(engine, pool[(c * requests_per_client + r) % len(pool)], params))

    async def opened(i: int, at: float, started: float) -> None:
        await anyio.sleep(max(0.0, started + at - time.perf_counter()))
        records.append(await one_request(engine, pool[i % len(pool)], params))

    async def body() -> tuple[float, Traffic]:
        async with engine:
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                if arrivals_s is None:
                    for c in range(concurrency):
                        tg.start_soon(closed, c)
                else:
                    for i, at in enumerate(arrivals_s):
                        tg.start_soon(opened, i, at, started)
            wall = time.perf_counter() - started
            return wall, _traffic(engine)

    wall, traffic = anyio.run(body)
    return summarise(config.name, concurrency, records, traffic, wall, simulated=False)


def sweep(
    plan: BenchPlan,
    recipe: EngineRecipe,
    pool: Sequence[list[int]],
    *,
    progress: Callable[[str], None] = lambda _: None,
    record: dict[str, list[RoutingRecorder]] | None = None,
) -> list[PointResult]:
    """Every configuration at every concurrency, interleaved: for each concurrency and repeat,
    each configuration once (the order rotates per repeat); the median-tokens/s repeat is kept."""
    params = SamplingParams(max_tokens=plan.max_tokens)
    results = []
    for c in plan.concurrency:
        runs: dict[str, list[PointResult]] = {cfg.name: [] for cfg in plan.configs}
        for rep in range(plan.repeats):
            order = plan.configs[rep % len(plan.configs) :] + plan.configs[: rep % len(plan.configs)]
            for cfg in order:
                hook = None
                if record is not None and cfg.name in ("ar", "dflash-token"):
                    kind = "speculative" if cfg.speculative else "autoregressive"
                    hook = lambda engine, kind=kind: record.setdefault(kind, []).append(
                        RoutingRecorder(engine.speculator)
                    )
                engine = recipe.build(plan, cfg)
                point = run_point(
                    engine,
                    cfg,
                    pool,
                    params,
                    concurrency=c,
                    requests_per_client=plan.requests_per_client(c),
                    recorder=hook,
                )
                runs[cfg.name].append(point)
                progress(f"{cfg.name} c={c}")
        for cfg in plan.configs:
            results.append(_median_point(runs[cfg.name], recipe, cfg))
    return results


def _median_point(points: list[PointResult], recipe: EngineRecipe, cfg: BenchConfig) -> PointResult:
    ranked = sorted(points, key=lambda p: p.tokens_per_s)
    chosen = ranked[(len(ranked) - 1) // 2]
    extra = dict(chosen.extra)
    extra |= {
        "repeats": len(points),
        "tokens_per_s_min": ranked[0].tokens_per_s,
        "tokens_per_s_max": ranked[-1].tokens_per_s,
        "tokens_per_s_runs": [p.tokens_per_s for p in points],  # in the order the repeats ran (paired ratios)
        "budgets": recipe.budgets(cfg),
    }
    return attrs.evolve(chosen, extra=extra)
