"""How well the drafter's confidence in a draft predicts that the target accepts it (bundled pair).

Speculative decoding of HumanEval headers with whole blocks verified, greedy or (`--temperature`)
sampled with rejection sampling. For every draft a verify reads (each up to the first rejected
one), its confidence (`DraftResult.confidence`: the peak of the drafter's distribution at its
position; greedy, the probability of the argmax it drafted) and whether it was accepted. Prints acceptance by
confidence bucket (the buckets of pdflash.spec.acceptance.CONFIDENCE_EDGES), by block position,
and the AUC of confidence for acceptance: the chance that an accepted draft was drafted with more
confidence than a rejected one. This is what `VerifyCut` (pdflash.spec.policy) relies on.

    PYTHONPATH=src python benchmarks/bench_confidence.py [--prompts 24] [--max-tokens 96] [--temperature 0.7]
        [--json FILE] [--plot PNG]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform

import torch
from tqdm import tqdm

from pdflash.bench.workload import humaneval_prompts
from pdflash.bundled import default_drafter, default_target
from pdflash.sampling import SamplingParams
from pdflash.spec.acceptance import CONFIDENCE_EDGES
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.config import ModelConfig
from pdflash.target.loader import load_target
from pdflash.target.tokenizer import TextTokenizer


def auc(accepted: list[float], rejected: list[float]) -> float:
    """P(an accepted draft's confidence > a rejected one's), ties counting half (Mann-Whitney)."""
    if not accepted or not rejected:
        return float("nan")  # no pair to compare
    ranked = sorted([(c, 1) for c in accepted] + [(c, 0) for c in rejected])
    wins, below, i = 0.0, 0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        tied_accepted = sum(kind for _, kind in ranked[i:j])
        tied_rejected = (j - i) - tied_accepted
        wins += tied_accepted * (below + tied_rejected / 2)
        below += tied_rejected
        i = j
    return wins / (len(accepted) * len(rejected))


def plot(buckets: list[dict], positions: list[dict], score: float, decoding: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    middles = [(b["low"] + b["high"]) / 2 for b in buckets]
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated (each bucket's prior)")
    ax.plot(middles, [b["accepted"] for b in buckets], marker="o", label=f"by confidence bucket (AUC {score:.2f})")
    ax.scatter(
        [p["mean_confidence"] for p in positions],
        [p["accepted"] for p in positions],
        marker="x",
        color="tab:red",
        label="by block position (at its mean confidence)",
    )
    ax.set_xlabel("drafter's confidence in its draft")
    ax.set_ylabel("share of drafts the target accepted")
    ax.set_title(f"Bundled pair, {decoding}: acceptance against the drafter's confidence", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24, help="HumanEval headers to decode (default 24)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled, unseeded, top-p 0.95"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", default=None, help="write the rows and summaries here")
    parser.add_argument("--plot", default=None, help="draw acceptance against confidence, and by position, to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = default_target()
    loaded = load_target(target_dir)
    drafter = load_drafter(default_drafter(target_dir), loaded.model)
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    tokenizer = TextTokenizer(target_dir, ModelConfig.from_file(target_dir / "config.json").vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if not params.greedy:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95)
    decoding = "greedy" if params.greedy else f"sampled at T={args.temperature}, top-p 0.95"
    rows: list[tuple[int, float, bool]] = []  # (position 1.., confidence, accepted)
    for text in tqdm(humaneval_prompts(args.prompts), desc="prompts"):
        session = spec.begin_session(tokenizer.encode(text), params)
        while not session.finished:
            [draft] = spec.draft_rounds([session])
            [result] = spec.verify_rounds([session])
            n = result.accepted_drafts
            rows += [(k + 1, c, k < n) for k, c in enumerate(draft.confidence[: n + 1])]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores; bundled pair, blocks of {spec.block_size}, "
        f"{args.prompts} HumanEval prompts, {args.max_tokens} tokens each, {decoding}; {len(rows)} drafts read"
    )
    buckets = []
    for i, (low, high) in enumerate(zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0), strict=True)):
        inside = [ok for _, c, ok in rows if bisect.bisect_right(CONFIDENCE_EDGES, c) == i]
        if inside:
            buckets.append({"low": low, "high": high, "drafts": len(inside), "accepted": sum(inside) / len(inside)})
            print(
                f"confidence [{low:.2f}, {high:.2f}): {len(inside):5d} drafts, accepted {sum(inside) / len(inside):.3f}"
            )
    positions = []
    for k in sorted({k for k, _, _ in rows}):
        at = [(c, ok) for p, c, ok in rows if p == k]
        share, mean = sum(ok for _, ok in at) / len(at), sum(c for c, _ in at) / len(at)
        positions.append({"position": k, "drafts": len(at), "accepted": share, "mean_confidence": mean})
        print(f"position {k}: {len(at):5d} drafts, accepted {share:.3f}, mean confidence {mean:.3f}")
    score = auc([c for _, c, ok in rows if ok], [c for _, c, ok in rows if not ok])
    print(f"AUC of confidence for acceptance: {score:.3f}")
    if args.plot:
        plot(buckets, positions, score, decoding, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "temperature": args.temperature,
                    "auc": score,
                    "buckets": buckets,
                    "positions": positions,
                    "rows": rows,
                },
                f,
            )


if __name__ == "__main__":
    main()
