"""Layer-ahead gating: how well does a MoE layer's router, applied one layer early, name what it routes?

Pre-gating (guessing layer L+1's experts from the residual stream entering it, through L+1's
own post-attention norm and router, before L+1's attention runs) would let an offloaded engine
copy L+1's experts while layer L still computes. It pays only if the guesses are right: this
measures them. Greedy decoding through the target alone (`forward(taps=...)`: the residual
stream after every layer, and the experts each token routed), over HumanEval prompts. For each
decoded token and each MoE layer after the first, the guess's top-k is compared with the
experts the layer then routed:

- precision by rank: the share of rank-r guesses that were routed;
- precision by router probability (softmax over all experts, in tenths);
- recall: the share of routed experts found among the guessed top-k.

    python benchmarks/layer_ahead_gating.py                      # the bundled target
    python benchmarks/layer_ahead_gating.py --target DIR --prompts 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import os
import platform
from collections import Counter

import torch
import torch.nn.functional as F
from tqdm import tqdm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="a Qwen3-MoE directory (default: the bundled target)")
    parser.add_argument("--prompts", type=int, default=8, help="HumanEval prompts (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument("--ranks", type=int, default=8, help="guess ranks reported (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pdflash.bench.workload import humaneval_prompts
    from pdflash.bundled import default_target
    from pdflash.target.loader import load_target
    from pdflash.target.model import Qwen3MoeModel, rms_norm

    loaded = load_target(args.target or default_target())
    model = loaded.model
    if not isinstance(model, Qwen3MoeModel) or loaded.tokenizer is None:
        raise SystemExit("layer_ahead_gating.py measures a Qwen3-MoE target with a tokenizer")
    cfg = model.config
    moe = cfg.moe_layer_ids
    ranks = min(args.ranks, cfg.num_experts)
    by_rank: Counter[tuple[int, bool]] = Counter()
    by_probability: Counter[tuple[int, bool]] = Counter()
    routed_total = routed_found = 0
    for prompt in tqdm(humaneval_prompts(args.prompts), desc="prompts"):
        cache = model.new_cache()
        ids = torch.tensor(loaded.tokenizer.encode(prompt))
        for step in range(args.max_tokens + 1):
            out = model.forward([ids], [cache], last_logits_only=True, taps=list(range(cfg.num_layers)))
            ids = out.logits[-1].argmax(-1, keepdim=True)
            if step == 0:  # the prompt's prefill: only decode steps are measured
                continue
            assert out.taps is not None
            streams = out.taps[-1].view(cfg.num_layers, cfg.hidden_size)  # [L, H]: after each layer
            for i, layer in enumerate(moe):
                if layer == 0:
                    continue
                weights = model.layers[layer]
                assert weights.router is not None
                entering = rms_norm(streams[layer - 1], weights.post_attention_norm, cfg.rms_norm_eps)
                probs = F.linear(entering, weights.router).float().softmax(-1)  # [E]
                top = probs.topk(ranks)
                routed = set(out.routed[-1, i].tolist())
                for rank, (expert, p) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
                    hit = expert in routed
                    by_rank[rank, hit] += 1
                    by_probability[min(int(p * 10), 9), hit] += 1
                routed_total += len(routed)
                routed_found += len(routed & set(top.indices[: cfg.top_k].tolist()))

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}; "
        f"target {args.target or 'bundled'}: {len(moe)} MoE layers, {cfg.num_experts} experts, top-{cfg.top_k}; "
        f"{args.prompts} prompts x {args.max_tokens} greedy tokens"
    )
    print(f"recall of the top-{cfg.top_k} guess: {routed_found / max(1, routed_total):.3f}")
    print("| guess rank | routed |")
    print("| ---: | ---: |")
    for rank in range(ranks):
        print(f"| {rank} | {_share(by_rank, rank)} |")
    print("| router probability | guesses | routed |")
    print("| --- | ---: | ---: |")
    for tenth in range(10):
        count = by_probability[tenth, True] + by_probability[tenth, False]
        if count:
            print(f"| {tenth / 10:.1f}-{(tenth + 1) / 10:.1f} | {count} | {_share(by_probability, tenth)} |")


def _share(counts: Counter[tuple[int, bool]], key: int) -> str:
    total = counts[key, True] + counts[key, False]
    return f"{counts[key, True] / total:.2f}" if total else "-"


if __name__ == "__main__":
    main()
