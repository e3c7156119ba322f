"""Greedy tokens/s of pdflash's autoregressive loop vs transformers' generate() on the same checkpoint.

Both run in this process, alternating, on the same prompt; prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--target", type=Path, help="Qwen3-MoE directory (default: a tiny random one written to a temp dir)"
    )
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import Qwen3MoeForCausalLM

    from pdflash.sampling import SamplingParams
    from pdflash.target.generate import generate_autoregressive
    from pdflash.target.loader import load_target
    from pdflash.target.tiny import write_tiny_target

    target = args.target or write_tiny_target(tempfile.mkdtemp())
    ours = load_target(target).model
    hf = Qwen3MoeForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = list(range(10, 42))
    params = SamplingParams(max_tokens=args.tokens)
    rates = {"pdflash": [], "transformers": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        n = len(generate_autoregressive(ours, prompt, params).token_ids)
        rates["pdflash"].append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        rates["transformers"].append((out.shape[1] - len(prompt)) / (time.perf_counter() - t0))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, no accelerator"
    )
    print(f"checkpoint: {target}; {args.tokens} greedy tokens, {args.repeats} repeats (median [min-max] tokens/s)")
    for name, r in rates.items():
        print(f"  {name:12s} {statistics.median(r):8.1f}  [{min(r):.1f}-{max(r):.1f}]")
    print(
        f"  ratio pdflash / transformers: {statistics.median(rates['pdflash']) / statistics.median(rates['transformers']):.2f}x"
    )


if __name__ == "__main__":
    main()
