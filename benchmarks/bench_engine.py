"""AsyncEngine throughput, overhead, admission cost and (if pdflash.offload exists) 2-D vs token-only
verify scheduling over offloaded experts, on one CPU run.

  1. Resident experts, greedy, closed loop at each concurrency: aggregate tokens/s with the
     drafter (DFlash) and without (AR), and engine overhead = share of wall time outside
     model forwards (prefill, draft + projection, verify on the model lane).
  2. Admission: a VerifyScheduler.tick (marginal charges + the pure 2-D function) over 256
     pending demands whose unions come from real drafted blocks of the target: the first tick
     (which builds every union's mask) and the next.
  3. Offloaded experts (emulated link, device cache a fraction of all experts), the same
     sweep with token-only and with 2-D budgets (bytes per tick = the device cache, and =
     the largest union one block can route): inter-token latency p50/p99, tokens/s and
     expert bytes fetched per generated token.

    python benchmarks/bench_engine.py [--target DIR --drafter DIR] [--concurrency 1 4 16 32]
        [--device cuda] [--json FILE]

On CUDA (`--device cuda`) the offloaded sweep copies experts over the real host-to-device link
from pinned memory unless `--link-gbps` asks for an emulated one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import torch
from tqdm import tqdm

from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.charging import largest_block_union_bytes
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.sampling import SamplingParams


def prompts(n: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts of 4..67 tokens."""
    return [[(7 * i + 13 * j) % (vocab - 8) for j in range(4 + (i * 37) % 64)] for i in range(n)]


async def closed_loop(
    engine: AsyncEngine, concurrency: int, per_client: int, params: SamplingParams, pool: list[list[int]]
) -> dict:
    """`concurrency` clients, each sending `per_client` requests one after another."""
    gaps: list[float] = []  # inter-token latency samples: delta gap / tokens it carries, one per token
    tokens = 0
    if hasattr(engine.provider, "reset_stats"):
        engine.provider.reset_stats()
    model_before = engine.stats().model_s

    async def client(c: int) -> None:
        nonlocal tokens
        for r in range(per_client):
            last = None
            async for out in engine.generate(pool[(c * per_client + r) % len(pool)], params):
                now = time.perf_counter()
                if last is not None and out.token_ids:
                    gaps.extend([(now - last) / len(out.token_ids)] * len(out.token_ids))
                last = now
                tokens += len(out.token_ids)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(concurrency):
            tg.start_soon(client, c)
    wall = time.perf_counter() - started
    stats = engine.stats()
    gaps.sort()
    fetched = stats.provider["expert_bytes_fetched"] if stats.provider else 0
    return {
        "tokens_per_s": tokens / wall,
        "overhead": 1 - (stats.model_s - model_before) / wall,
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else float("nan"),
        "itl_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan"),
        "fetched_per_token": fetched / tokens,
        "tau": stats.mean_acceptance_length,
    }


async def sweep(engine: AsyncEngine, args, params, pool, bar) -> dict[int, dict]:
    results = {}
    async with engine:
        for c in args.concurrency:
            results[c] = await closed_loop(engine, c, args.requests_per_client, params, pool)
            bar.update()
    return results


def admission_us(engine: AsyncEngine, pool: list[list[int]], pending: int, repeats: int) -> tuple[float, float, int]:
    """Median µs of a first tick over `pending` fresh demands from real drafts (every union's
    mask built) and of the next tick (masks kept); and the demands' mean union size."""
    spec = engine.speculator
    sessions = spec.begin_sessions([(p, SamplingParams(max_tokens=64)) for p in pool[:64]])
    drafts = spec.draft_rounds([s for s in sessions if not s.finished])
    for s in sessions:
        spec.release(s)
    block_bytes = largest_block_union_bytes(spec.expert_nbytes, spec.block_size, spec.target.config.top_k)
    resident = frozenset(sorted(spec.expert_nbytes)[: len(spec.expert_nbytes) // 4])
    first, second = [], []
    for _ in range(repeats):
        scheduler = VerifyScheduler(
            token_budget=64,
            token_cap=8 * 64,
            byte_budget=block_bytes,
            byte_cap=4 * block_bytes,
            byte_map=spec.expert_nbytes,
        )
        for i in range(pending):
            d = drafts[i % len(drafts)]
            scheduler.register(i, d.tokens, d.expert_union, d.expert_bytes, d.fetch_bytes)
        for samples in (first, second):
            started = time.perf_counter()
            scheduler.tick(resident, frozenset())
            samples.append(time.perf_counter() - started)
    union = round(statistics.mean(len(d.expert_union) for d in drafts))
    return statistics.median(first) * 1e6, statistics.median(second) * 1e6, union


def table(title: str, rows: dict[str, dict[int, dict]], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}\n")
    print("| run | concurrency | " + " | ".join(name for name, _, _ in columns) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in columns) + " |")
    for run, points in rows.items():
        for c, p in points.items():
            print(f"| {run} | {c} | " + " | ".join(format(p[key], fmt) for _, key, fmt in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="Qwen3-MoE directory (default: a tiny random one in a temp dir)")
    parser.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: a tiny random one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request (default 32)")
    parser.add_argument("--pending", type=int, default=256, help="pending demands in the admission timing")
    parser.add_argument("--admission-repeats", type=int, default=200)
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="offload: device cache / all experts")
    parser.add_argument(
        "--link-gbps", type=float, help="offload: emulated link GB/s (default 16 on the CPU; the real link on CUDA)"
    )
    parser.add_argument("--device", default="cpu", help="torch device of the engines (default cpu)")
    parser.add_argument("--dtype", help="compute dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    parser.add_argument("--json", type=Path, help="also write every table's figures to this JSON file")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads (default 1: shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)

    if args.target is None:
        from pdflash.target.tiny import write_tiny_drafter, write_tiny_target

        scratch = Path(tempfile.mkdtemp(prefix="bench-engine-"))
        args.target = write_tiny_target(scratch / "target")
        args.drafter = args.drafter or write_tiny_drafter(scratch / "drafter", args.target)
    params = SamplingParams(max_tokens=args.max_tokens)
    if args.link_gbps is None and not args.device.startswith("cuda"):
        args.link_gbps = 16.0
    model = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.concurrency))
    dflash = AsyncEngine.from_pretrained(args.target, args.drafter, **model)
    pool = prompts(64, dflash.speculator.target.config.vocab_size)
    try:
        import pdflash.offload  # noqa: F401

        offload = {"expert_cache_fraction": args.cache_fraction, "link_gbps": args.link_gbps}
    except ImportError:
        offload = None

    accelerator = torch.cuda.get_device_name() if args.device.startswith("cuda") else "no accelerator"
    link = f"emulated {args.link_gbps:g} GB/s link" if args.link_gbps else "the real host-to-device link"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op thread(s), {accelerator}; Python {platform.python_version()}"
    )
    print(
        f"target {args.target}, drafter {args.drafter} (block {dflash.speculator.block_size}); greedy, "
        f"{args.max_tokens} tokens per request, {args.requests_per_client} requests per client, one run"
    )

    runs = 2 + (3 if offload else 0)
    with tqdm(total=runs * len(args.concurrency), desc="sweep points", leave=False) as bar:
        resident = {
            "DFlash": anyio.run(sweep, dflash, args, params, pool, bar),
            "AR": anyio.run(
                sweep,
                AsyncEngine.from_pretrained(args.target, None, **model),
                args,
                params,
                pool,
                bar,
            ),
        }
        offloaded = {}
        if offload:
            probe = dflash.speculator
            block_bytes = largest_block_union_bytes(probe.expert_nbytes, probe.block_size, probe.target.config.top_k)
            cache_bytes = int(args.cache_fraction * sum(probe.expert_nbytes.values()))
            tokens = max(args.concurrency) * probe.block_size
            settings = {"token-only": {}}
            for label, byte_budget in (("cache", cache_bytes), ("block union", block_bytes)):
                settings[f"2-D, bytes/tick = {label}"] = dict(
                    verify_token_budget=tokens,
                    verify_token_cap=tokens,
                    verify_byte_budget=byte_budget,
                    verify_byte_cap=max(block_bytes, 2 * byte_budget),
                )
            for name, budgets in settings.items():
                engine = AsyncEngine.from_pretrained(args.target, args.drafter, offload=offload, **model, **budgets)
                offloaded[name] = anyio.run(sweep, engine, args, params, pool, bar)
                print(f"{name}: {budgets or 'no byte budget'}")

    table(
        "Resident experts (tokens/s aggregate; overhead = wall outside model forwards / wall)",
        resident,
        [("tokens/s", "tokens_per_s", ".1f"), ("τ", "tau", ".2f"), ("engine overhead", "overhead", ".1%")],
    )
    first_us, next_us, union = admission_us(dflash, pool, args.pending, args.admission_repeats)
    print(
        f"\nAdmission: one VerifyScheduler.tick, marginal charges, {args.pending} pending demands "
        f"(~{union} experts per union, 1/4 resident), median of {args.admission_repeats}: {first_us:.0f} µs "
        f"for the first tick (every union's mask built), {next_us:.0f} µs for the next"
    )
    if offload:
        table(
            f"Offloaded experts: {link}, device cache {args.cache_fraction:.0%} of all experts",
            offloaded,
            [
                ("tokens/s", "tokens_per_s", ".1f"),
                ("ITL p50 ms", "itl_p50_ms", ".2f"),
                ("ITL p99 ms", "itl_p99_ms", ".2f"),
                ("fetched bytes/token", "fetched_per_token", ",.0f"),
                ("engine overhead", "overhead", ".1%"),
            ],
        )
    else:
        print("\npdflash.offload is not importable: offloaded sweep skipped")
    if args.json is not None:
        machine = dict(accelerator=accelerator, cpu_cores=os.cpu_count(), torch=torch.__version__, link=link)
        models = dict(target=str(args.target), drafter=str(args.drafter), max_tokens=args.max_tokens)
        report = dict(machine=machine, models=models, resident=resident, offloaded=offloaded)
        report["admission_us"] = [first_us, next_us]
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
