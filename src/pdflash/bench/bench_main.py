"""The body of `pdflash bench`: time scale, sweep, open-loop run, routing traces, report."""

from __future__ import annotations

import argparse
import sys

import attrs
import torch

from pdflash.bench.commands import _emit, _progress
from pdflash.bench.configs import parse_configs
from pdflash.bench.profiles import TimeScale, get_profile
from pdflash.bench.ratios import paired_ratios, ratio_table
from pdflash.bench.report import machine, markdown_table
from pdflash.bench.routing import write_traces
from pdflash.bench.runner import (
    BenchPlan,
    engine_recipe,
    measure_ar_step_s,
    prompt_pool,
    run_point,
    sweep,
    token_routed_bytes,
)
from pdflash.bench.workload import poisson_arrivals
from pdflash.sampling import SamplingParams

QUICK = {"concurrency": [1, 4], "max_tokens": 16, "prompts": 8, "min_requests": 4, "poisson_requests": 4}


def run(args: argparse.Namespace) -> int:
    from pdflash.bundled import default_drafter, default_target

    torch.set_num_threads(args.torch_threads)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    configs = tuple(parse_configs(args.configs))
    profile = get_profile(args.profile, args.profiles_file)
    target = args.target or default_target()
    drafter = args.drafter or default_drafter(target)
    if drafter is None:
        raise ValueError(f"{target} has no default drafter; give --drafter (B1-B3 speculate)")
    pool = prompt_pool(target, args.prompts)

    if args.calibrate is not None:
        from pdflash.bench.calibrate import calibrate

        with _progress(1 + 6 * 3, "calibrating", args.json == "-") as bar:
            costs = calibrate(target, drafter, pool, progress=lambda _: bar.update())
        costs.to_json(args.calibrate)
        print(f"calibration written to {args.calibrate}: {attrs.asdict(costs)}")
        return 0

    ar_step_s = measure_ar_step_s(target, pool[:4])
    scale = TimeScale.for_profile(profile, ar_step_s=ar_step_s, token_routed_bytes=token_routed_bytes(target))
    if args.cache_share is not None:  # another cache on the same link (checked by commands.check_positive)
        scale = attrs.evolve(scale, cache_fraction=args.cache_share)
    plan = BenchPlan(
        target=target,
        drafter=drafter,
        configs=configs,
        concurrency=tuple(args.concurrency),
        max_tokens=args.max_tokens,
        min_requests=args.min_requests,
        repeats=args.repeats,
        policy=args.eviction,
        device=args.device,
        drafter_lane=args.drafter_lane,
        prefill_mode=args.prefill_mode,
    )
    recipe = engine_recipe(plan, scale)
    record: dict | None = {} if args.record_routing is not None else None
    total = len(plan.concurrency) * plan.repeats * len(configs) + (len(configs) if args.poisson_requests else 0)
    with _progress(total, "bench points", args.json == "-") as bar:
        points = sweep(plan, recipe, pool, progress=lambda _: bar.update(), record=record)
        open_points, rate = _open_loop(args, plan, recipe, pool, points, bar)

    if record is not None:
        write_traces(
            args.record_routing, _ordered_traces(record, pool), {"target": str(target), "drafter": str(drafter)}
        )
    ratios = paired_ratios(points)
    header = {
        "title": f"pdflash bench, bundled pair in the {profile.name} regime",
        "machine": machine(),
        "profile": profile.name,
        "time_scale": attrs.asdict(scale),
        "target": str(target),
        "drafter": str(drafter),
        "max_tokens": plan.max_tokens,
        "min_requests": plan.min_requests,
        "max_num_seqs": recipe.max_num_seqs,
        "eviction": plan.policy,
        "prefill_mode": plan.prefill_mode,
        "prompts": f"{len(pool)} HumanEval headers, greedy",
        "open_loop_rate_per_s": rate,
        "open_loop": [p.as_dict() for p in open_points],
        "command": "pdflash " + " ".join(sys.argv[1:]),
        "paired_ratios": [r.as_dict() for r in ratios],
    }
    lines = [
        f"# {header['title']}",
        "",
        f"machine: {header['machine']}",
        f"{scale.describe()} (link emulated: bytes / rate slept on the prefetch lane)",
        f"{header['prompts']}, {plan.max_tokens} tokens per request, >= {plan.min_requests} requests per point, "
        f"{plan.repeats} interleaved repeat(s) per point (median tokens/s kept), eviction {plan.policy}",
        "",
        markdown_table(points),
    ]
    if table := ratio_table(ratios):
        lines += [
            "",
            "Each repeat ran every configuration once, back to back; ratios of the same repeat's runs:",
            "",
            table,
        ]
    if open_points:
        lines += [
            "",
            f"Open loop: {args.poisson_requests} Poisson arrivals at {rate:.2f} requests/s",
            "",
            markdown_table(open_points),
        ]
    _emit(args, header, points, "\n".join(lines))
    return 0


def _open_loop(args, plan, recipe, pool, points, bar):
    if not args.poisson_requests:
        return [], None
    rate = args.poisson_rate
    if rate is None:
        closed = [p for p in points if p.config == plan.configs[0].name]
        rate = 0.5 * max(p.requests / p.wall_s for p in closed)
    arrivals = poisson_arrivals(rate, args.poisson_requests, seed=0)
    params = SamplingParams(max_tokens=plan.max_tokens)
    results = []
    for cfg in plan.configs:
        results.append(run_point(recipe.build(plan, cfg), cfg, pool, params, concurrency=0, arrivals_s=arrivals))
        bar.update()
    return results, rate


def _ordered_traces(record: dict, pool) -> dict[str, list[dict]]:
    """Per kind, the first recorded sequence of each pool prompt, for the longest covered prefix of the pool."""
    traces = {}
    for kind, recorders in record.items():
        by_prompt: dict[tuple, dict] = {}
        for recorder in recorders:
            for seq in recorder.sequences():
                by_prompt.setdefault(tuple(seq["prompt_ids"]), seq)
        ordered = []
        for prompt in pool:
            if tuple(prompt) not in by_prompt:
                break
            ordered.append(by_prompt[tuple(prompt)])
        traces[kind] = ordered
    return traces
