"""The `pdflash bench` and `pdflash simulate` subcommands: flags, wiring, progress and output.

Owns argument parsing for both commands (registered into the main parser by
`register_subcommands`), turning flags into a BenchPlan / SimSetup, the progress bar, and
where reports go. Must not measure or simulate by itself: runner, calibrate and simulator do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pdflash.bench.configs import BASELINES
from pdflash.cli.options import add_engine_layout_flags
from pdflash.engine.prefill_mode import PREFILL_MODES

DEFAULT_PROFILE = "qwen3-30b-a3b@h200-pcie5"
BENCH_CONFIGS = ",".join(BASELINES)
SIMULATE_CONFIGS = ",".join((*BASELINES, "adaptive"))


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the report as one JSON object to FILE (alone: print only that object to stdout)",
    )


def _common(p: argparse.ArgumentParser, concurrency: list[int], configs: str) -> None:
    p.add_argument(
        "--configs",
        default=configs,
        help=f"comma-separated configurations, run side by side (default {configs}; "
        "B0 ar = autoregressive offloaded, B1 dflash-token = DFlash token-only scheduling, "
        "B2 dflash-2d = DFlash 2-D (tokens, bytes) scheduling, B3 resident = DFlash, no offloading; "
        "B2d dflash-derived = working-set budgets + yield order, B4 adaptive = the engine's "
        "defaults (adaptive speculation + B2d's scheduling), B4t adaptive-token, B3a resident-adaptive, B3p resident-ar (plain decoding, resident); "
        "NAME@PROJECTOR picks the route projector, e.g. dflash-2d@router,dflash-2d@route-head)",
    )
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=concurrency, help=f"closed-loop clients (default {concurrency})"
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"deployment profile, one of {', '.join(_profile_names())} (default {DEFAULT_PROFILE})",
    )
    p.add_argument("--profiles-file", type=Path, help="a profile file in the shipped profiles.json format")
    p.add_argument("--min-requests", type=int, default=8, help="requests per point at least (default 8)")
    p.add_argument(
        "--eviction",
        default="activation",
        choices=["lru", "lfu", "activation"],
        help="cache policy (default activation)",
    )
    p.add_argument("--plots", type=Path, metavar="PREFIX", help="write PREFIX-throughput/-latency/-bytes.png")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write the Markdown report to FILE")
    _json_flag(p)


def register_subcommands(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure configurations side by side in a deployment's regime (time-scaled emulated link)",
        description="Closed-loop concurrency sweep and an open-loop Poisson run over HumanEval headers, "
        "configurations interleaved in one process. --profile time-scales the emulated link: it is set "
        "so that (fetch time of one token's routed experts) / (one AR step measured here at start) equals "
        "the profile's R, and the device cache holds the profile's budget share of all experts.",
    )
    bench.add_argument("--target", type=Path, help="target directory (default: the bundled trained pair)")
    bench.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: the bundled one)")
    _common(bench, [1, 4, 16, 32], BENCH_CONFIGS)
    bench.add_argument(
        "--cache-share",
        type=float,
        metavar="F",
        help="device cache as a share of all experts, in (0, 1], instead of the profile's budget share "
        "(the link's time scale is unchanged)",
    )
    bench.add_argument("--device", default="cpu", help="device the engines run on (cpu, cuda; default cpu)")
    bench.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    bench.add_argument("--prompts", type=int, default=32, help="HumanEval headers in the pool (default 32)")
    bench.add_argument("--repeats", type=int, default=1, help="interleaved repeats per point; median kept")
    bench.add_argument("--poisson-requests", type=int, default=16, help="open-loop requests per config (0: skip)")
    bench.add_argument(
        "--poisson-rate", type=float, help="open-loop arrivals/s (default: half of B0's best closed-loop requests/s)"
    )
    bench.add_argument("--quick", action="store_true", help="a short run (< 3 min on 2 cores): c=1,4; 16 tokens")
    bench.add_argument("--calibrate", type=Path, metavar="FILE", help="measure per-forward costs, write FILE, stop")
    bench.add_argument("--record-routing", type=Path, metavar="FILE", help="record routing traces for simulate")
    bench.add_argument("--torch-threads", type=int, default=1, help="intra-op threads (default 1: shared cores)")
    add_engine_layout_flags(bench)
    bench.set_defaults(func=cmd_bench)

    sim = sub.add_parser(
        "simulate",
        help="discrete-event simulation of the engine at a profile's real shapes",
        description="Runs the pipelined engine on a virtual clock (target lane, drafter lane and copy engine "
        "overlapping; one admission tick per verify launch): the REAL VerifyScheduler, derived budgets, "
        "speculation policy and eviction policies; forwards from a cost model (the profile's roofline, or "
        "--calibration), one serial copy engine at the profile's link rate; routing replayed from --routing "
        "or drawn from a Zipf model; "
        "acceptance lengths from a recorded distribution. --validate BENCH_JSON instead simulates the "
        "bundled pair at every point of a `pdflash bench --json` report and prints the error table.",
    )
    _common(sim, [1, 4, 16, 32, 64], SIMULATE_CONFIGS)
    sim.add_argument("--expert-cache-bytes", type=int, help="device expert budget (default: the profile's)")
    sim.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    sim.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    sim.add_argument("--block-size", type=int, default=8, help="DFlash block (default 8)")
    sim.add_argument("--routing", type=Path, help="replay this --record-routing trace instead of the Zipf model")
    sim.add_argument("--zipf-s", type=float, default=0.8, help="Zipf exponent of per-layer popularity (default 0.8)")
    sim.add_argument("--locality", type=float, default=0.3, help="P(token reuses the last token's experts) (0.3)")
    sim.add_argument("--acceptance", type=Path, help="take acceptance lengths from this routing trace")
    sim.add_argument("--calibration", type=Path, help="a `bench --calibrate` file: cost model of this machine")
    sim.add_argument(
        "--compute-scale",
        default="1",
        help="--validate: multiply the calibrated forward costs by this factor, or 'auto': the bench report's "
        "measured AR step / the calibration's (the machine's load when the report ran; default 1)",
    )
    sim.add_argument("--validate", type=Path, metavar="BENCH_JSON", help="simulate a bench report's points")
    sim.add_argument(
        "--prefill-mode",
        choices=PREFILL_MODES,
        default="auto",
        help="where prompts prefill: inside the next batched verify, or alone (default auto: inside verifies "
        "with experts offloaded or a drafter; --validate takes the bench report's, alone for reports before it was recorded)",
    )
    sim.add_argument(
        "--lock-step",
        action="store_true",
        help="--validate: model the lock-step engine (main up to 73fabf9: drafts on the verify thread, no tick "
        "while a verify runs) that measured reports before the pipelined engine",
    )
    sim.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="independent engine replicas (serve --replicas): c clients spread evenly, tokens/s summed (default 1)",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=cmd_simulate)


def _profile_names() -> list[str]:
    from pdflash.bench.profiles import load_profiles

    return sorted(load_profiles())


POSITIVE = (
    "concurrency",
    "min_requests",
    "max_tokens",
    "prompts",
    "repeats",
    "prompt_tokens",
    "block_size",
    "replicas",
)


def check_positive(args: argparse.Namespace) -> None:
    """Counts must be >= 1, cache sizes > 0 and a cache share in (0, 1]: say which flag and what it got."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')}={v} is invalid: it must be >= 1")
    cache = getattr(args, "expert_cache_bytes", None)
    if cache is not None and cache <= 0:
        raise ValueError(f"--expert-cache-bytes={cache} is invalid: it must be > 0")
    share = getattr(args, "cache_share", None)
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--cache-share={share} is invalid: it is the device cache's share of all experts, in (0, 1]")


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, disable=quiet and not sys.stderr.isatty())


def _emit(args, header: dict, points, markdown: str) -> None:
    from pdflash.bench.report import plot, write_json

    if args.plots is not None:
        header = header | {"plots": [str(p) for p in plot(points, args.plots, header.get("title", ""))]}
    text = write_json(None if args.json in (None, "-") else args.json, header, points)
    if args.markdown is not None:
        args.markdown.write_text(markdown + "\n")
    if args.json == "-":
        print(text)
    else:
        print(markdown)


def cmd_bench(args: argparse.Namespace) -> int:
    from pdflash.bench import bench_main

    return _run("bench", bench_main.run, args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdflash.bench import simulate_main

    return _run("simulate", simulate_main.run, args)


def _run(name: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)` after the positive-value checks; a bad value is one line on stderr and exit code 2."""
    try:
        check_positive(args)
        return run(args)
    except ValueError as exc:
        print(f"pdflash {name}: {exc}", file=sys.stderr)
        return 2
