"""Offline batch generation: many prompts through one engine at once, results as JSON lines.

    python examples/batch_generate.py                              # a few built-in prompts
    python examples/batch_generate.py --prompts prompts.txt --max-tokens 64 > out.jsonl
    python examples/batch_generate.py --target DIR --drafter DIR --max-num-seqs 16

Every prompt is submitted at once; the engine admits up to --max-num-seqs at a time and
batches their draft and verify rounds. Output order follows the input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio

from pdflash import AsyncEngine, SamplingParams
from pdflash.bundled import default_drafter, default_target

DEFAULT_PROMPTS = [
    "def quicksort(xs):",
    "The capital of France is",
    "import torch\n",
    "Once upon a time",
    "SELECT name FROM users WHERE",
    "fn main() {",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate completions for many prompts concurrently (JSON lines out).")
    p.add_argument("--prompts", type=Path, help="a text file, one prompt per line (default: a few built-in prompts)")
    p.add_argument("--target", type=Path, help="Hugging Face Qwen3-MoE directory (default: the built-in model)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: the built-in model's)")
    p.add_argument("--no-spec", action="store_true", help="decode autoregressively")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences the engine runs at once")
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    prompts = args.prompts.read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    prompts = [p for p in prompts if p.strip()]
    target = args.target or default_target()
    drafter = None if args.no_spec else (args.drafter or (default_drafter(target) if args.target is None else None))
    engine = AsyncEngine.from_pretrained(
        target, drafter, max_num_seqs=args.max_num_seqs, max_waiting=max(256, len(prompts))
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    results: list[dict | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        ids, text = [], ""
        async for out in engine.generate(prompts[i], params):
            ids += out.token_ids
            text += out.text
        m = out.metrics
        results[i] = {
            "prompt": prompts[i],
            "text": text,
            "token_ids": ids,
            "finish_reason": out.finish_reason,
            "acceptance_lengths": list(m.acceptance_lengths),
            "ttft_s": m.ttft_s,
        }

    started = time.perf_counter()
    async with engine:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        stats = engine.stats()
    elapsed = time.perf_counter() - started
    for result in results:
        print(json.dumps(result))
    print(
        f"{len(prompts)} prompts, {stats.generated_tokens} tokens in {elapsed:.2f} s "
        f"({stats.generated_tokens / elapsed:.1f} tokens/s), mean acceptance {stats.mean_acceptance_length:.2f}, "
        f"verify batch sizes {stats.verify_batch_sizes}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    anyio.run(main, parse_args())
