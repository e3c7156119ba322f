"""Stream one completion from the async engine, token deltas as they arrive.

python examples/async_stream.py                         # the built-in model
python examples/async_stream.py --prompt "def fib(n):" --max-tokens 64 --temperature 0.7 --seed 1
python examples/async_stream.py --target DIR [--drafter DIR | --no-spec]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

from pdflash import AsyncEngine, SamplingParams
from pdflash.bundled import default_drafter, default_target


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Stream one completion from pdflash's AsyncEngine.")
    p.add_argument("--target", type=Path, help="Hugging Face Qwen3-MoE directory (default: the built-in model)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: the built-in model's)")
    p.add_argument("--no-spec", action="store_true", help="decode autoregressively")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    target = args.target or default_target()
    drafter = None if args.no_spec else (args.drafter or (default_drafter(target) if args.target is None else None))
    engine = AsyncEngine.from_pretrained(target, drafter, max_num_seqs=4)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    started = time.perf_counter()
    async with engine:
        async for out in engine.generate(args.prompt, params):
            print(out.text, end="", flush=True)  # out.token_ids: the delta's new token ids
    m = out.metrics
    rounds = m.acceptance_lengths
    print(
        f"\n\n{m.generated_tokens} tokens in {time.perf_counter() - started:.2f} s, finish: {out.finish_reason}, "
        f"TTFT {1000 * m.ttft_s:.0f} ms, "
        f"mean acceptance {sum(rounds) / len(rounds) if rounds else 0:.2f} over {len(rounds)} verify rounds, "
        f"projected expert bytes {m.expert_bytes:,}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    anyio.run(main, parse_args())
