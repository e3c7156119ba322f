"""Two source trees of pdflash side by side: the same closed-loop run through each tree's public API.

Measures what a change did to the engine by running an older checkout (a `git worktree` of an
earlier commit) and this one interleaved, on the same machine, in fresh processes: each run
imports `pdflash` from one tree's `src/` (PYTHONPATH) and runs `--concurrency` clients of
HumanEval requests (greedy, or sampled with `--temperature`) through `AsyncEngine.generate`, the API both trees share. Without
`--config` each tree loads the bundled pair resident (`AsyncEngine.from_pretrained`); with
`--config NAME` (a `pdflash bench` configuration, e.g. `ar` or `adaptive`) it builds that
configuration's engine as `pdflash bench` does, behind the same emulated link for both trees
(measured once, here, for `--profile`). Prints one line per run and the median ratio of the
trees' tokens/s (and, behind a link, their bytes fetched per token).

    git worktree add /tmp/lockstep 73fabf9   # the engine before the pipeline (issue 22)
    python benchmarks/bench_versions.py /tmp/lockstep . --concurrency 16 --repeats 3
    git worktree add /tmp/before HEAD~1      # a change to the offloaded engine
    python benchmarks/bench_versions.py /tmp/before . --config ar --concurrency 4 --requests-per-client 2 \
        --max-tokens 48 --repeats 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RUN = r"""
import json, sys, time
import anyio, torch
torch.set_num_threads(int(sys.argv[1]))
from pdflash.engine.async_engine import AsyncEngine
from pdflash.sampling import SamplingParams

job = json.load(sys.stdin)
if job["config"] is None:
    engine = AsyncEngine.from_pretrained(max_num_seqs=job["concurrency"])
else:  # as pdflash bench builds it, behind the link the parent measured
    from pdflash.bench.configs import parse_configs
    from pdflash.bench.profiles import TimeScale
    from pdflash.bench.runner import BenchPlan, engine_recipe
    from pdflash.bundled import default_drafter, default_target

    config = parse_configs(job["config"])[0]
    target = default_target()
    plan = BenchPlan(
        target=target, drafter=default_drafter(target), configs=(config,), concurrency=(job["concurrency"],),
        max_tokens=job["max_tokens"], min_requests=1, repeats=1,
    )
    engine = engine_recipe(plan, TimeScale(**job["scale"])).build(plan, config)
params = SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"], top_p=job["top_p"])
prompts = job["prompts"]

async def client(c, tokens):
    for r in range(job["requests_per_client"]):
        async for out in engine.generate(prompts[(c * job["requests_per_client"] + r) % len(prompts)], params):
            tokens.append(len(out.token_ids))

async def main():
    async with engine:
        await client(0, [])  # warm-up: one request alone, not timed
        warm = (engine.stats().provider or {}).get("expert_bytes_fetched", 0)
        tokens = []
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c in range(job["concurrency"]):
                tg.start_soon(client, c, tokens)
        wall = time.perf_counter() - started
        fetched = (engine.stats().provider or {}).get("expert_bytes_fetched", 0) - warm
    print(json.dumps({"tokens": sum(tokens), "wall_s": wall, "bytes_fetched": fetched}))

anyio.run(main)
"""


def run_tree(tree: Path, job: dict, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PDFLASH_NO_COMPILE="1")
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(threads)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=tree,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs=2, type=Path, help="the baseline tree, then the tree measured against it")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default 16)")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (default); above: sampled requests, unseeded, top-p 0.95",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per tree; medians kept (default 3)")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads per run (default 2: the lanes split them)"
    )
    parser.add_argument(
        "--config", default=None, help="a pdflash bench configuration, built as the bench builds it (default: resident)"
    )
    parser.add_argument(
        "--profile",
        default="qwen3-30b-a3b@h200-pcie5",
        help="with --config: the regime to time-scale (bench's default)",
    )
    parser.add_argument(
        "--regime-ratio", type=float, default=None, help="with --config: override the profile's R (1: balanced)"
    )
    args = parser.parse_args()

    from pdflash.bench.workload import humaneval_prompts
    from pdflash.bundled import default_target
    from pdflash.target.config import ModelConfig
    from pdflash.target.tokenizer import TextTokenizer

    target = default_target()
    tokenizer = TextTokenizer(target, ModelConfig.from_file(target / "config.json").vocab_size)
    prompts = [tokenizer.encode(text) for text in humaneval_prompts(32)]
    scale, setting = None, "bundled pair resident"
    if args.config is not None:
        import attrs
        import torch

        from pdflash.bench.profiles import TimeScale, get_profile
        from pdflash.bench.runner import measure_ar_step_s, token_routed_bytes

        # the AR step at the runs' thread count: with more threads than free cores it read 70x slow
        torch.set_num_threads(args.threads)
        routed = token_routed_bytes(target)
        scale = TimeScale.for_profile(
            get_profile(args.profile), ar_step_s=measure_ar_step_s(target, prompts[:4]), token_routed_bytes=routed
        )
        if args.regime_ratio is not None:  # the same link rescaled: one token's fetch = R AR steps
            ratio = scale.regime_ratio / args.regime_ratio
            scale = attrs.evolve(scale, regime_ratio=args.regime_ratio, link_gbps=scale.link_gbps * ratio)
        setting = f"bundled pair, {args.config}; {scale.describe()}"
    job = {
        "concurrency": args.concurrency,
        "requests_per_client": args.requests_per_client,
        "max_tokens": args.max_tokens,
        "prompts": prompts,
        "config": args.config,
        "scale": attrs.asdict(scale) if scale is not None else None,
        "temperature": args.temperature,
        "top_p": 0.95 if args.temperature > 0 else 1.0,
    }
    decoding = "greedy" if args.temperature == 0 else f"sampled at T={args.temperature}, top-p 0.95"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), "
        f"torch threads {args.threads}; {setting}; {decoding}, c={args.concurrency}, "
        f"{args.requests_per_client} requests per client, {args.max_tokens} tokens each"
    )
    rates: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    per_token: dict[Path, list[float]] = {tree: [] for tree in args.trees}  # bytes fetched per token
    for repeat in range(args.repeats):
        for tree in args.trees if repeat % 2 == 0 else args.trees[::-1]:
            result = run_tree(tree.resolve(), job, args.threads)
            rates[tree].append(result["tokens"] / result["wall_s"])
            per_token[tree].append(result.get("bytes_fetched", 0) / result["tokens"])
            fetched = f", {per_token[tree][-1] / 1e3:,.0f} kB fetched/token" if scale is not None else ""
            print(
                f"  {tree}: {rates[tree][-1]:.1f} tok/s ({result['tokens']} tokens in {result['wall_s']:.2f} s{fetched})"
            )
    base, new = (statistics.median(rates[t]) for t in args.trees)
    line = f"median: {args.trees[0]} {base:.1f} tok/s, {args.trees[1]} {new:.1f} tok/s, ratio {new / base:.2f}x"
    if scale is not None:
        kb = [statistics.median(per_token[t]) / 1e3 for t in args.trees]
        line += f"; {kb[0]:,.0f} against {kb[1]:,.0f} kB fetched/token"
    print(line)


if __name__ == "__main__":
    main()
