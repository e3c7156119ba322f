"""Sampled acceptance length τ of DFlash on the bundled pair: HumanEval prompts, seeded, per sampling setting.

τ is the mean number of tokens a verify round emits (bonus included). Seeds are fixed (prompt
i uses seed i), so a run is reproducible and two versions of the code can be compared on the
same draws of the same prompts: run this file once per version (e.g. with PYTHONPATH pointing
at the other checkout's src); it uses only the public Speculator API.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts to use (default 20)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.7])
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import pdflash
    from pdflash.bench.workload import humaneval_prompts
    from pdflash.bundled import default_drafter, default_target
    from pdflash.sampling import SamplingParams
    from pdflash.spec.drafter import load_drafter
    from pdflash.spec.speculator import Speculator, speculative_generate
    from pdflash.target.loader import load_target

    source = Path(pdflash.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {args.threads} threads; "
        f"pdflash from {source} (commit {commit.stdout.strip() or '?'}, plus any uncommitted changes)"
    )
    loaded = load_target(default_target())
    drafter = load_drafter(default_drafter(default_target()), loaded.model)
    spec = Speculator(
        loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union", block_size=args.block_size
    )
    prompts = [loaded.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    print(
        f"{len(prompts)} HumanEval prompts, {args.max_tokens} new tokens, block {args.block_size}, seed = prompt index"
    )
    for temperature in args.temperature:
        lengths: list[int] = []
        for i, ids in enumerate(prompts):
            params = SamplingParams(
                temperature=temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=i
            )
            lengths += speculative_generate(spec, ids, params).acceptance_lengths
        print(
            f"T={temperature} top_p={args.top_p} top_k={args.top_k}: τ {statistics.mean(lengths):.2f} "
            f"over {len(lengths)} rounds; P(draft k accepted | drafts before it accepted): "
            + " ".join(f"k={k} {rate:.2f}" for k, rate in enumerate(acceptance_by_position(lengths, args.block_size)))
        )


def acceptance_by_position(lengths: list[int], block_size: int) -> list[float]:
    """Per draft position k: of the rounds that accepted drafts 0 … k-1, the share that accepted draft k too."""
    accepted = [length - 1 for length in lengths]  # drafts accepted; the bonus is not a draft
    rates = []
    for k in range(block_size - 1):
        reached = [a for a in accepted if a >= k]
        if not reached:
            break
        rates.append(sum(a > k for a in reached) / len(reached))
    return rates


if __name__ == "__main__":
    main()
