"""The engine at concurrency 16 on the bundled pair (DFlash), eager vs compiled steps, in one process.

    python benchmarks/bench_engine_compiled.py [--concurrency 16] [--tokens 48] [--threads 2]

Submits `concurrency` HumanEval prompts at once to an engine with that many seats, eager then
compiled, and prints aggregate generated tokens/s, the compile warm-up and their ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import anyio
import torch


async def _drive(engine, prompts, params) -> tuple[int, float]:
    counts = [0] * len(prompts)

    async def one(i: int) -> None:
        async for out in engine.generate(prompts[i], params):
            counts[i] += len(out.token_ids)

    async with engine:
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return sum(counts), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pdflash import AsyncEngine, SamplingParams
    from pdflash.bench.workload import humaneval_prompts

    prompts = humaneval_prompts(args.concurrency)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rates = {}
    for compiled in (False, True):
        started = time.perf_counter()
        engine = AsyncEngine.from_pretrained(max_num_seqs=args.concurrency, compile=compiled, progress=compiled)
        build_s = time.perf_counter() - started
        tokens, wall_s = anyio.run(_drive, engine, prompts, params)
        rates[compiled] = tokens / wall_s
        print(f"{'compiled' if compiled else 'eager':8s} build {build_s:6.1f} s, {tokens} tokens in {wall_s:.1f} s: "
              f"{rates[compiled]:.1f} tokens/s")  # fmt: skip
    print(
        f"machine: {os.cpu_count()} CPU cores, {args.threads} torch threads, load average {os.getloadavg()[0]:.1f}; "
        f"concurrency {args.concurrency}, compiled / eager {rates[True] / rates[False]:.2f}x"
    )


if __name__ == "__main__":
    main()
