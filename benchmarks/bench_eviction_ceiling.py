"""How far could eviction, or the choice of whom to verify together, still cut bytes per token?

For each configuration and concurrency, one closed-loop run through the public API in a
deployment profile's regime records every request a forward makes of the expert cache (its
MoE layer and routed union, in order). That trace is then replayed offline as demand paging
on the same number of slots (a forward pins its own union; prefetches left out) under:

- `lru` and `activation` (the engine's default), the real policies of pdflash.offload.eviction;
- `next-launch`: `activation`, except that experts the next batched forward routes (its
  `layers` requests, known exactly here) are evicted last: the most a projection of the next
  verify's union could add to eviction;
- `opt`: Belady's optimal policy (evict the expert used again furthest ahead), which no
  online policy beats on that trace.

`activation ÷ opt` misses is the ceiling of what caching alone can still cut from the bytes
fetched per token at that point. "Union share" is the mean share of a layer's experts one forward
routes: near 1, a batch needs the whole layer whatever is cached.

`--cohorts TRACE` asks the same of admission, offline, over a routing trace that `pdflash bench
--record-routing` wrote (each sequence's rounds and the experts each routed): n sequences
(closed-loop clients, each running its share of the recorded sequences one after another)
decode their recorded rounds either together (every live sequence in every batched forward,
what the engine's admission does when nothing binds) or split into cohorts of n/2 or n/4 that
take turns, each cohort running `quantum` rounds before the next one's turn (a working-set
schedule: the cohort in service keeps its experts cached while it runs). Each schedule's
accesses are replayed as above; the figure is misses per committed token. Besides the
recorded autoregressive and speculative (blocks of 8) runs, `block-2` and `block-4` verify
shorter fixed blocks, and `oracle` is the best any choice of block lengths could reach with
this drafter: every round verifies exactly the tokens it commits (pdflash.bench.regrouping).

    python benchmarks/bench_eviction_ceiling.py --configs ar,dflash-token,adaptive --concurrency 1 16 32
    python benchmarks/bench_eviction_ceiling.py --cohorts docs/data/routing-dfe2a08.json.gz --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections.abc import Sequence

import torch
from tqdm import tqdm

from pdflash.bench.configs import parse_configs
from pdflash.bench.paging import REPLAYED, Access, RecordingPolicy, replay
from pdflash.bench.profiles import get_profile
from pdflash.bench.regrouping import KINDS, batch_accesses, clients, recorded_rounds, schedule
from pdflash.bench.runner import bundled_behind_link, engine_recipe, run_point
from pdflash.bundled import default_target
from pdflash.engine.async_engine import AsyncEngine
from pdflash.offload.device_cache import OffloadedExperts
from pdflash.sampling import SamplingParams
from pdflash.target.config import ModelConfig

SPLIT_KINDS = ("autoregressive", "speculative")  # the kinds also replayed in cohorts
QUANTA = (1, 4, 16, 10**9)  # rounds a cohort runs per turn (10**9: until its sequences end)


def cohort_rows(path: str, concurrency: Sequence[int], slots: int, layers: int, *, split: bool) -> list[dict]:
    """Misses per committed token of every (trace kind, n, cohort, quantum) schedule of the trace at
    `path` on `slots` slots (`split` False: every sequence together only)."""
    rows = []
    for kind in KINDS:
        recorded = recorded_rounds(path, kind, layers)
        for n in concurrency:
            if n > len(recorded):
                raise SystemExit(f"--concurrency {n}: {path} holds only {len(recorded)} {kind} sequences")
            served = clients(recorded, n)
            rounds, tokens = [len(r) for r in served], sum(r.committed_tokens for c in served for r in c)
            cohorts = (
                sorted({n, max(1, n // 2), max(1, n // 4)}, reverse=True) if split and kind in SPLIT_KINDS else [n]
            )
            for cohort in cohorts:
                for quantum in QUANTA[:1] if cohort == n else QUANTA:
                    accesses = [
                        access
                        for forward in schedule(rounds, cohort, quantum)
                        for access in batch_accesses([served[s][k] for s, k in forward], layers)
                    ]
                    misses = {p: replay(accesses, slots, p, layers) for p in ("activation", "opt")}
                    rows.append(
                        {
                            "kind": kind,
                            "slots": slots,
                            "concurrency": n,
                            "cohort": cohort,
                            "quantum": quantum,
                            "forwards": len(accesses) // layers,
                            "misses_per_token": {p: m / tokens for p, m in misses.items()},
                        }
                    )
    return rows


def _together(rows: list[dict]) -> dict[tuple[int, int, str], float]:
    """(slots, n, kind) -> misses per token under activation, every sequence together."""
    return {
        (r["slots"], r["concurrency"], r["kind"]): r["misses_per_token"]["activation"]
        for r in rows
        if r["cohort"] == r["concurrency"]
    }


def print_shares(rows: list[dict], total: int) -> None:
    """Every kind against plain decoding, all sequences together, at each cache size."""
    together = _together(rows)
    kinds = [k for k in KINDS if k != "autoregressive"]
    print(f"\n| cache share (slots) | n | AR misses / token | AR ÷ {' | AR ÷ '.join(kinds)} |")
    print("|---|---|---|" + "---|" * len(kinds))
    for slots, n in sorted({(s, n) for s, n, _ in together}):
        ar = together[(slots, n, "autoregressive")]
        ratios = " | ".join(f"{ar / together[(slots, n, k)]:.2f}" for k in kinds)
        print(f"| {slots / total:.0%} ({slots}) | {n} | {ar:.2f} | {ratios} |")


def plot_shares(rows: list[dict], total: int, path: str) -> None:
    """PNG: AR's misses per token over each kind's (above 1: that kind fetches fewer), against cache share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    together = _together(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({n for _, n, _ in together}):
        for kind, style in (("oracle", "-"), ("speculative", "--")):
            slots = sorted({s for s, m, _ in together if m == n})
            ax.plot(
                [s / total for s in slots],
                [together[(s, n, "autoregressive")] / together[(s, n, kind)] for s in slots],
                style,
                marker="o",
                label=f"{'oracle blocks' if kind == 'oracle' else 'blocks of 8'}, c = {n}",
            )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("device cache, share of all experts")
    ax.set_ylabel("plain decoding's misses per token ÷ speculation's")
    ax.set_title("Link bytes speculation saves over plain decoding (replayed trace)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_cohorts(rows: list[dict]) -> None:
    print("\n| trace | n | cohort | quantum (rounds) | forwards | misses / token, activation | misses / token, opt |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        quantum = "all" if r["quantum"] == QUANTA[-1] else r["quantum"]
        quantum = "–" if r["cohort"] == r["concurrency"] else quantum
        m = r["misses_per_token"]
        print(
            f"| {r['kind']} | {r['concurrency']} | {r['cohort']} | {quantum} | {r['forwards']} | "
            f"{m['activation']:.2f} | {m['opt']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="ar,dflash-token,adaptive", help="offloaded configurations (bench names)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="closed-loop clients")
    parser.add_argument("--profile", default="qwen3-30b-a3b@h200-pcie5", help="deployment profile (pdflash bench)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per request (default 48)")
    parser.add_argument("--min-requests", type=int, default=32, help="requests per point at least (default 32)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--cohorts", default=None, metavar="TRACE", help="replay this routing trace's cohorts instead")
    parser.add_argument(
        "--cache-shares",
        type=float,
        nargs="+",
        default=None,
        help="with --cohorts: cache sizes (shares of all experts) to replay at; cohorts split at the first "
        "(default: the profile's share)",
    )
    parser.add_argument("--plot", default=None, help="with --cohorts: write the cache-share figure to this PNG")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)

    target = default_target()
    config = ModelConfig.from_file(target / "config.json")
    layers = sum(config.moe_layers)  # one cache request per MoE layer per forward
    if args.cohorts is not None:
        shares = args.cache_shares or [get_profile(args.profile).cache_share]
        rows = []
        for i, share in enumerate(shares):
            probe = AsyncEngine.from_pretrained(target, None, offload={"expert_cache_fraction": share})
            assert isinstance(probe.provider, OffloadedExperts)
            slots = probe.provider.num_slots  # what the engine's cache holds at that share
            print(f"{args.cohorts}: demand paging on {slots} slots ({share:.1%} of the experts)")
            rows += cohort_rows(args.cohorts, args.concurrency, slots, layers, split=i == 0)
        print_cohorts([r for r in rows if r["slots"] == rows[0]["slots"]])
        total = layers * config.num_experts
        print_shares(rows, total)
        if args.plot:
            plot_shares(rows, total, args.plot)
        _write(args, rows)
        return
    configs = parse_configs(args.configs)
    if not all(c.offloaded for c in configs):
        parser.error("--configs: every configuration must offload its experts (a resident one has no cache)")
    run = bundled_behind_link(
        configs, args.concurrency, profile=args.profile, max_tokens=args.max_tokens, min_requests=args.min_requests
    )
    plan, scale, pool = run.plan, run.scale, run.pool
    recipe = engine_recipe(plan, scale)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), torch "
        f"{torch.__version__} with {args.torch_threads} thread(s); bundled pair, {args.profile}, "
        f"{scale.describe()}; {args.max_tokens} greedy tokens, >= {args.min_requests} requests per point"
    )
    rows = []
    points = [(c, cfg) for c in plan.concurrency for cfg in configs]
    for c, cfg in tqdm(points, desc="points", unit="point"):
        trace: list[Access] = []

        def install(engine: AsyncEngine, trace: list[Access] = trace) -> None:
            assert isinstance(engine.provider, OffloadedExperts), "an offloaded configuration has a device cache"
            engine.provider.policy = RecordingPolicy(engine.provider.policy, trace)

        engine = recipe.build(plan, cfg)
        point = run_point(
            engine,
            cfg,
            pool,
            SamplingParams(max_tokens=args.max_tokens),
            concurrency=c,
            requests_per_client=plan.requests_per_client(c),
            recorder=install,
        )
        assert isinstance(engine.provider, OffloadedExperts)
        slots = engine.provider.num_slots
        misses = {p: replay(trace, slots, p, layers) for p in REPLAYED}
        requests = sum(len(union) for _, union in trace)
        rows.append(
            {
                "config": cfg.name,
                "concurrency": c,
                "tokens_per_s": point.tokens_per_s,
                "bytes_per_token": point.bytes_per_token,
                "engine_hit_rate": point.hit_rate,
                "slots": slots,
                "forwards": len(trace) // layers,
                "union_share": statistics.mean(len(u) for _, u in trace) / config.num_experts if trace else 0.0,
                "replay_hit_rate": {p: 1 - m / requests if requests else 0.0 for p, m in misses.items()},
                "activation_over_opt": misses["activation"] / misses["opt"] if misses["opt"] else float("nan"),
            }
        )
    print(
        "\n| config | c | tok/s | kB fetched/token | engine hit | union share | "
        "replay hit: lru / activation / next-launch / opt | activation ÷ opt misses |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hits = " / ".join(f"{r['replay_hit_rate'][p]:.2f}" for p in REPLAYED)
        print(
            f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['bytes_per_token'] / 1e3:.1f} | "
            f"{r['engine_hit_rate']:.2f} | {r['union_share']:.2f} | {hits} | {r['activation_over_opt']:.2f} |"
        )
    _write(args, rows)


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_eviction_ceiling.py", "args": vars(args), "rows": rows}, f)


if __name__ == "__main__":
    main()
