"""Where does the link idle? One closed-loop run per configuration, its lanes' busy intervals laid side by side.

Behind a profile's emulated link, each configuration runs once per repeat (fresh engine, the
bundled pair, greedy HumanEval headers, `pdflash bench`'s setup). Read after the run, before the
engine closes: the target lane's and the drafter lane's busy intervals (`Lane.intervals`: every
call, a forward that waits on its copies included) and the cache's copies
(`OffloadedExperts.copy_intervals()`). Printed as shares of the wall: the link busy; the link
idle while the target lane runs (compute no copy overlaps: a verify's tail, the head,
sampling); the link idle while the target lane waits (of it, with the drafter busy: a batch
drafting, nothing of its next round known yet); both idle (the loop's hand-offs); and the
link's idle share in each tenth of the wall (the first tenth holds the prefills). The lanes
remember their last 4,096 calls: keep runs short.

    python benchmarks/lane_timeline.py --configs ar,adaptive --concurrency 16 --repeats 2
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator

import anyio

from pdflash.bench.configs import parse_configs
from pdflash.bench.runner import add_linked_run_options, engine_recipe, linked_run, one_request
from pdflash.measure import overlap_s
from pdflash.sampling import SamplingParams

Intervals = list[tuple[float, float]]


def merged(intervals: Intervals, start: float, end: float) -> Intervals:
    """The union of `intervals` clipped to [start, end]: time-ordered and disjoint."""
    out: list[list[float]] = []
    for s, e in sorted((max(s, start), min(e, end)) for s, e in intervals if e > start and s < end):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def gaps(busy: Intervals, start: float, end: float) -> Intervals:
    """[start, end] less the disjoint, time-ordered `busy`."""
    out, cursor = [], start
    for s, e in busy:
        if s > cursor:
            out.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        out.append((cursor, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(e - s for s, e in intervals)


def intersection(a: Intervals, b: Intervals) -> Intervals:
    """Where both disjoint, time-ordered timelines are busy."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def one_run(run, recipe, config, concurrency: int, max_tokens: int) -> dict:
    engine = recipe.build(run.plan, config)
    params, per_client = SamplingParams(max_tokens=max_tokens), run.plan.requests_per_client(concurrency)
    seen: dict = {}

    async def client(c: int) -> None:
        for r in range(per_client):
            await one_request(engine, run.pool[(c * per_client + r) % len(run.pool)], params)

    async def body() -> None:
        async with engine:
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for c in range(concurrency):
                    tg.start_soon(client, c)
            lanes = engine._running
            assert lanes is not None and engine.provider is not None, "an offloaded configuration"
            seen.update(
                start=started,
                end=time.perf_counter(),
                target=list(lanes.target.intervals),
                drafter=list(lanes.drafter.intervals) if lanes.drafter is not None else [],
                link=engine.provider.copy_intervals(),
                decisions=dict(sorted(engine.planner.decisions.items())),
                offload=engine.provider.stats(),
            )

    anyio.run(body)
    return seen


def report(name: str, concurrency: int, seen: dict) -> str:
    start, end = seen["start"], seen["end"]
    wall = end - start
    target, drafter, link = (merged(seen[k], start, end) for k in ("target", "drafter", "link"))
    link_idle, target_idle = gaps(link, start, end), gaps(target, start, end)
    waiting = intersection(link_idle, target_idle)
    everything = merged(seen["target"] + seen["drafter"] + seen["link"], start, end)
    tenths = []
    for k in range(10):
        a, b = start + wall * k / 10, start + wall * (k + 1) / 10
        tenths.append(length(intersection(link_idle, [(a, b)])) / (wall / 10))
    share = lambda seconds: f"{seconds / wall:.1%}"
    return (
        f"{name} c={concurrency}: wall {wall:.2f} s, link busy {share(length(link))}, target lane busy "
        f"{share(length(target))}, drafter busy {share(length(drafter))} | link idle: target running "
        f"{share(overlap_s(link_idle, target))}, target waiting {share(length(waiting))} (drafter busy "
        f"{share(overlap_s(waiting, drafter))}), nothing running {share(length(gaps(everything, start, end)))}"
        f" | link idle per tenth: {' '.join(f'{t:.0%}' for t in tenths)} | blocks {seen['decisions']}"
    )


def sweep_options(parser: argparse.ArgumentParser, *, configs: str, concurrency: list[int], repeats: int) -> None:
    """The linked-run options and `--repeats`, with these defaults."""
    add_linked_run_options(parser, configs=configs, concurrency=concurrency)
    parser.add_argument(
        "--repeats", type=int, default=repeats, help=f"runs per configuration, interleaved (default {repeats})"
    )


def sweep(args: argparse.Namespace) -> Iterator[tuple[str, int, Callable[[], dict]]]:
    """(configuration, concurrency, its closed-loop run to call) for each run of `args`' sweep,
    repeats interleaved, after printing the setup's scale (the AR step, the link, the cache)."""
    configs = parse_configs(args.configs)
    run = linked_run(args, configs)
    recipe = engine_recipe(run.plan, run.scale)
    print(
        f"AR step here {run.scale.ar_step_s * 1e3:.2f} ms, emulated link {run.scale.link_gbps * 1e3:.1f} MB/s, "
        f"cache {run.scale.cache_fraction:.1%}, torch threads {args.torch_threads}"
    )
    for concurrency in args.concurrency:
        for _ in range(args.repeats):
            for config in configs:
                yield (
                    config.name,
                    concurrency,
                    functools.partial(one_run, run, recipe, config, concurrency, args.max_tokens),
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep_options(parser, configs="ar,adaptive", concurrency=[16], repeats=1)
    for name, concurrency, one in sweep(parser.parse_args()):
        print(report(name, concurrency, one()), flush=True)


if __name__ == "__main__":
    main()
