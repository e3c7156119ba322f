"""Does the link ever idle while compute runs? Wall with the link against max(compute, link time).

For each configuration and concurrency, the same closed-loop run twice, interleaved: with the
emulated link of a deployment profile, and with a free link (copies take no time; the same
cache). In a link-bound regime nothing beats the link's own time, bytes fetched / link rate;
in a compute-bound one nothing beats the free-link wall. A pipeline that never lets one wait
on the other reaches max(free-link wall, bytes / rate): the ratio printed (issue 22's bar is
<= 1.05). `--regime-ratio` rescales the link (R = one token's fetch time / one AR step: the
profile's R is link-bound; R = 1 is balanced, where overlap matters most). Where the wall of the
run with the link went, as shares of it: the link carrying fetches; forwards running while the
link idled (compute no copy overlapped); nothing running (hand-offs between rounds).

    python benchmarks/bench_overlap.py --configs ar,dflash-token,adaptive --concurrency 1 16 32
    python benchmarks/bench_overlap.py --regime-ratio 1 --cache-fraction 0.6
"""

from __future__ import annotations

import argparse
import os
import platform

import attrs
import torch
from tqdm import tqdm

from pdflash.bench.configs import parse_configs
from pdflash.bench.runner import add_linked_run_options, engine_recipe, linked_run, run_point
from pdflash.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linked_run_options(parser, configs="ar,dflash-token,adaptive", concurrency=[1, 16, 32])
    parser.add_argument("--regime-ratio", type=float, default=None, help="override the profile's R (1: balanced)")
    parser.add_argument("--cache-fraction", type=float, default=None, help="override the profile's cache share")
    args = parser.parse_args()

    configs = parse_configs(args.configs)
    run = linked_run(args, configs)
    plan, scale, pool = run.plan, run.scale, run.pool
    if args.regime_ratio is not None:
        scale = attrs.evolve(
            scale, regime_ratio=args.regime_ratio, link_gbps=scale.link_gbps * scale.regime_ratio / args.regime_ratio
        )
    if args.cache_fraction is not None:
        scale = attrs.evolve(scale, cache_fraction=args.cache_fraction)
    free = attrs.evolve(scale, link_gbps=None)
    recipes = {"link": engine_recipe(plan, scale), "free": engine_recipe(plan, free)}
    params = SamplingParams(max_tokens=args.max_tokens)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), torch "
        f"{torch.__version__} with {args.torch_threads} thread(s); bundled pair, {args.profile}, "
        f"R = {scale.regime_ratio:.1f}, link {scale.link_gbps * 1e3:.2f} MB/s, cache {scale.cache_fraction:.1%}"
    )
    print(
        "| config | c | wall, link s | wall, free link s | bytes / link rate s | wall / max | kB/token "
        "| link busy | compute, link idle | nothing |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rate = scale.link_gbps * 1e9
    with tqdm(total=2 * len(configs) * len(args.concurrency), desc="runs", leave=False) as bar:
        for c in args.concurrency:
            for config in configs:
                runs = {}
                for name, recipe in recipes.items():
                    engine = recipe.build(plan, config)
                    runs[name] = run_point(
                        engine, config, pool, params, concurrency=c, requests_per_client=plan.requests_per_client(c)
                    )
                    bar.update()
                link, unlinked = runs["link"], runs["free"]
                link_s = link.bytes_per_token * link.tokens / rate
                bound = max(unlinked.wall_s, link_s)
                compute_only = max(0.0, 1.0 - link.link_busy_share - link.engine_overhead)
                print(
                    f"| {config.name} | {c} | {link.wall_s:.2f} | {unlinked.wall_s:.2f} | {link_s:.2f} | "
                    f"{link.wall_s / bound:.2f} | {link.bytes_per_token / 1e3:,.0f} | {link.link_busy_share:.0%} | "
                    f"{compute_only:.0%} | {link.engine_overhead:.0%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
