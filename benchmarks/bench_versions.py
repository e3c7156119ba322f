"""Two source trees of pdflash side by side: the same closed-loop run through each tree's public API.

Measures what a change did to the engine by running an older checkout (a `git worktree` of an
earlier commit) and this one interleaved, on the same machine, in fresh processes: each run
imports `pdflash` from one tree's `src/` (PYTHONPATH), loads the bundled pair resident, and runs
`--concurrency` clients of greedy HumanEval requests through `AsyncEngine.generate`, the API
both trees share. Prints one line per run and the median ratio of the trees' tokens/s.

    git worktree add /tmp/lockstep 73fabf9   # the engine before the pipeline (issue 22)
    python benchmarks/bench_versions.py /tmp/lockstep . --concurrency 16 --repeats 3
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
engine = AsyncEngine.from_pretrained(max_num_seqs=job["concurrency"])
params = SamplingParams(max_tokens=job["max_tokens"])
prompts = job["prompts"]

async def client(c, tokens):
    for r in range(job["requests_per_client"]):
        async for out in engine.generate(prompts[(c * job["requests_per_client"] + r) % len(prompts)], params):
            tokens.append(len(out.token_ids))

async def main():
    async with engine:
        await client(0, [])  # warm-up: one request alone, not timed
        tokens = []
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c in range(job["concurrency"]):
                tg.start_soon(client, c, tokens)
        wall = time.perf_counter() - started
    print(json.dumps({"tokens": sum(tokens), "wall_s": wall}))

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
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per tree; medians kept (default 3)")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads per run (default 2: the lanes split them)"
    )
    args = parser.parse_args()

    from pdflash.bench.workload import humaneval_prompts
    from pdflash.bundled import default_target
    from pdflash.target.config import ModelConfig
    from pdflash.target.tokenizer import TextTokenizer

    target = default_target()
    tokenizer = TextTokenizer(target, ModelConfig.from_file(target / "config.json").vocab_size)
    job = {
        "concurrency": args.concurrency,
        "requests_per_client": args.requests_per_client,
        "max_tokens": args.max_tokens,
        "prompts": [tokenizer.encode(text) for text in humaneval_prompts(32)],
    }
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), "
        f"torch threads {args.threads}; bundled pair resident, greedy, c={args.concurrency}, "
        f"{args.requests_per_client} requests per client, {args.max_tokens} tokens each"
    )
    rates: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    for repeat in range(args.repeats):
        for tree in args.trees if repeat % 2 == 0 else args.trees[::-1]:
            result = run_tree(tree.resolve(), job, args.threads)
            rates[tree].append(result["tokens"] / result["wall_s"])
            print(f"  {tree}: {rates[tree][-1]:.1f} tok/s ({result['tokens']} tokens in {result['wall_s']:.2f} s)")
    base, new = (statistics.median(rates[t]) for t in args.trees)
    print(f"median: {args.trees[0]} {base:.1f} tok/s, {args.trees[1]} {new:.1f} tok/s, ratio {new / base:.2f}x")


if __name__ == "__main__":
    main()
