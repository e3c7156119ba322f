"""Expert traffic of offloaded decoding: link bytes per output token and exposed fetch time,
autoregressive vs DFlash speculative (block 8), each with and without route-ahead prefetch,
measured side by side in one run over one target, the same prompts and a fresh cache per row.

Without an accelerator the link is emulated (bandwidth + latency slept on the prefetch lane)
and every figure is labelled so. With no --target, a random tiny checkpoint (and a random
drafter) is written to a temporary directory: random weights route like noise and the drafter
is rarely accepted, so the ratios show the machinery, not a trained pair.

    PYTHONPATH=src python benchmarks/bench_offload.py [--target DIR] [--drafter DIR]
        [--link-gbps 16] [--cache-fraction 0.25] [--prompts 4] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pdflash.offload import POLICIES, Priority, load_offloaded_target
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.config import ModelConfig
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target

BENCH_TARGET = {"hidden_size": 128, "moe_intermediate_size": 256, "num_hidden_layers": 6}  # 384 KiB experts


def run_row(args, target: Path, drafter: Path | None, route_ahead: bool, prompts: list[list[int]]) -> dict:
    """Decode every prompt, one session at a time, with a fresh offloaded target; return the row's figures."""
    loaded = load_offloaded_target(
        target,
        device=args.device,
        expert_cache_fraction=args.cache_fraction,
        policy=args.policy,
        link_gbps=args.link_gbps,
        link_latency_s=args.link_latency_us * 1e-6,
    )
    provider = loaded.model.experts
    spec = Speculator(
        loaded.model,
        load_drafter(drafter, loaded.model) if drafter else None,
        expert_nbytes=loaded.expert_nbytes,
        block_size=args.block_size if drafter else None,
        resident=provider.resident,
    )
    params = SamplingParams(max_tokens=args.max_tokens)
    tokens = rounds = 0
    started = time.perf_counter()
    for prompt in prompts:
        session = spec.begin_session(prompt, params)
        while not session.finished:
            draft = spec.draft_round(session)
            if route_ahead:
                provider.prefetch(draft.expert_union, Priority.ROUTE_AHEAD)
            spec.verify_round(session)
            rounds += 1
        tokens += len(session.emitted)
        spec.release(session)
    seconds = time.perf_counter() - started
    provider.lane.wait_idle()
    stats = provider.stats()
    provider.close()
    return {
        "mode": f"speculative B={args.block_size}" if drafter else "autoregressive",
        "route_ahead": route_ahead,
        "tokens": tokens,
        "tau": tokens / rounds if rounds else 0.0,
        "bytes_per_token": stats["expert_bytes_fetched"] / tokens,
        "link_ms_per_token": 1e3 * stats["expert_bytes_fetched"] / (args.link_gbps * 1e9) / tokens,
        "exposed_ms_per_token": 1e3 * stats["exposed_fetch_s"] / tokens,
        "exposed_s": stats["exposed_fetch_s"],
        "hit_rate": stats["expert_cache_hit_rate"],
        "coverage": stats["prefetch_coverage"],
        "waste_per_token": stats["prefetch_waste_bytes"] / tokens,
        "tokens_per_second": tokens / seconds,
        "stats": stats,
    }


def table(rows: list[dict]) -> str:
    base, link = rows[0], rows[0]["stats"]["link"]
    lines = [
        f"| mode | route-ahead | tokens | τ | link bytes / token | × AR | {link}-link ms / token (bytes ÷ bandwidth) | "
        f"exposed fetch ms / token ({link} link) | hit rate (bytes) | prefetch coverage | "
        "prefetch waste bytes / token | tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {'yes' if r['route_ahead'] else 'no'} | {r['tokens']} | {r['tau']:.2f} | "
            f"{r['bytes_per_token']:,.0f} | {r['bytes_per_token'] / base['bytes_per_token']:.2f} | "
            f"{r['link_ms_per_token']:.3f} | {r['exposed_ms_per_token']:.3f} | {r['hit_rate']:.3f} | "
            f"{r['coverage']:.3f} | {r['waste_per_token']:,.0f} | {r['tokens_per_second']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="target checkpoint directory (default: a random tiny one)")
    parser.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: a random one for the target)")
    parser.add_argument("--device", default="cpu", help="device of the cache and the model (default cpu)")
    parser.add_argument("--link-gbps", type=float, default=16.0, help="emulated link bandwidth, GB/s (default 16)")
    parser.add_argument("--link-latency-us", type=float, default=0.0, help="emulated latency per fetch, µs (default 0)")
    parser.add_argument(
        "--cache-fraction", type=float, default=0.25, help="device cache / all expert bytes (default 0.25)"
    )
    parser.add_argument(
        "--policy", default="activation", choices=sorted(POLICIES), help="eviction policy (default activation)"
    )
    parser.add_argument("--block-size", type=int, default=8, help="speculative block size (default 8)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts, decoded one after another (default 4)")
    parser.add_argument("--prompt-len", type=int, default=24, help="tokens per random prompt (default 24)")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the tiny checkpoint (default 0)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        target = args.target or write_tiny_target(Path(scratch) / "target", seed=args.seed, **BENCH_TARGET)
        drafter = args.drafter or write_tiny_drafter(Path(scratch) / "drafter", target, block_size=args.block_size)
        vocab = ModelConfig.from_file(target / "config.json").vocab_size
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        run_row(argparse.Namespace(**{**vars(args), "max_tokens": 4}), target, drafter, True, prompts[:1])  # warm-up
        cases = [(None, False), (None, True), (drafter, False), (drafter, True)]
        rows = [run_row(args, target, d, ahead, prompts) for d, ahead in tqdm(cases, desc="bench rows")]

    first = rows[0]["stats"]
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, Python {platform.python_version()}, device {args.device}"
    )
    print(
        f"link: {first['link']} {args.link_gbps:g} GB/s + {args.link_latency_us:g} µs per fetch; cache "
        f"{args.cache_fraction:.0%} = {first['expert_cache_slots']} experts x {first['expert_slot_bytes']:,} bytes; "
        f"policy {first['policy']}; {args.prompts} prompts x {args.max_tokens} new tokens, greedy"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
