"""The body of `pdflash simulate`: a profile at real scale, or `--validate` against a bench report."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

from pdflash.bench.commands import _emit, _progress
from pdflash.bench.configs import CONFIGS, BenchConfig, parse_configs, two_d_budgets
from pdflash.bench.costs import CalibratedCosts, RooflineCosts
from pdflash.bench.metrics import PointResult
from pdflash.bench.profiles import get_profile
from pdflash.bench.replicated import replicated_point
from pdflash.bench.report import markdown_table, validation_table
from pdflash.bench.routing import TraceRouting, ZipfRouting
from pdflash.bench.sim_clients import simulate_closed_loop
from pdflash.bench.simulator import SimSetup

CPU_SLOT_ITEMSIZE = 4  # the CPU engine's expert arena is float32


def default_acceptance() -> tuple[list[int], str]:
    """Acceptance lengths recorded from the bundled pair (HumanEval, greedy, B=8), shipped as data."""
    data = json.loads(resources.files("pdflash.bench").joinpath("acceptance.json").read_text())
    return data["acceptance_lengths"], data["source"]


def _requests_per_client(min_requests: int, c: int) -> int:
    return max(1, -(-min_requests // c))


def trace_kind(cfg: BenchConfig) -> str:
    """Which recorded trace a configuration replays (pdflash.bench.routing.TraceRouting)."""
    if cfg.speculation == "adaptive" and cfg.speculative:
        return "adaptive"
    return "speculative" if cfg.speculative else "autoregressive"


def run(args: argparse.Namespace) -> int:
    if args.validate is not None:
        if args.replicas != 1:
            raise ValueError("--validate compares one engine with a bench report; drop --replicas")
        return validate(args)
    if args.calibration is not None:
        raise ValueError(
            "--calibration describes this machine's forwards; use it with --validate (bundled pair shapes)"
        )
    configs = parse_configs(args.configs)
    profile = get_profile(args.profile, args.profiles_file)
    m = profile.model
    budget = profile.expert_budget_bytes if args.expert_cache_bytes is None else args.expert_cache_bytes
    if budget // m.expert_bytes < 2:
        raise ValueError(
            f"--expert-cache-bytes={budget} holds {budget // m.expert_bytes} experts of {m.expert_bytes:,} bytes "
            f"({m.name}); the cache needs at least 2 (>= {2 * m.expert_bytes} bytes)"
        )
    byte_map = {(layer, e): m.expert_bytes for layer in range(m.num_hidden_layers) for e in range(m.num_experts)}
    if args.acceptance is not None:
        acceptance, acceptance_source = (
            TraceRouting.load(args.acceptance, "speculative").acceptance_lengths(),
            str(args.acceptance),
        )
    else:
        acceptance, acceptance_source = default_acceptance()
    block = args.block_size
    largest = m.num_hidden_layers * min(block * m.num_experts_per_tok, m.num_experts) * m.expert_bytes
    max_seqs = max(args.concurrency)
    budgets = two_d_budgets(max_num_seqs=max_seqs, block_size=block, cache_bytes=budget, largest_union_bytes=largest)

    def routing_for(cfg: BenchConfig):
        if args.routing is not None:
            return TraceRouting.load(args.routing, trace_kind(cfg))
        return ZipfRouting(
            layers=m.num_hidden_layers,
            experts=m.num_experts,
            top_k=m.num_experts_per_tok,
            exponent=args.zipf_s,
            locality=args.locality,
            acceptance=acceptance,
            seed=args.seed,
        )

    points: list[PointResult] = []
    with _progress(len(args.concurrency) * len(configs), "simulated points", args.json == "-") as bar:
        for c in args.concurrency:
            for cfg in configs:
                setup = SimSetup(
                    config=cfg,
                    costs=RooflineCosts(profile),
                    routing=routing_for(cfg),
                    byte_map=byte_map,
                    moe_layers=tuple(range(m.num_hidden_layers)),
                    top_k=m.num_experts_per_tok,
                    block_size=block,
                    cache_slots=budget // m.expert_bytes,
                    cache_bytes=budget,
                    link_bytes_per_s=profile.link.h2d_bytes_per_s,
                    policy=args.eviction,
                    max_num_seqs=max_seqs,
                    budgets=budgets if cfg.two_dimensional else None,
                    prefill_mode=args.prefill_mode,
                )

                def one_engine(load: int, setup: SimSetup = setup) -> PointResult:
                    return simulate_closed_loop(
                        setup,
                        [args.prompt_tokens] * max(args.min_requests, load),
                        concurrency=load,
                        requests_per_client=_requests_per_client(args.min_requests, load),
                        max_tokens=args.max_tokens,
                    )

                points.append(one_engine(c) if args.replicas == 1 else replicated_point(c, args.replicas, one_engine))
                bar.update()
    replicas = "" if args.replicas == 1 else f", {args.replicas} replicas (c clients spread evenly; summed)"
    header = {
        "title": f"pdflash simulate, {profile.name}, {budget / 1e9:g} GB expert budget{replicas}",
        "replicas": args.replicas,
        "profile": profile.name,
        "regime_ratio": profile.regime_ratio,
        "ar_step_ms": profile.ar_step_s * 1e3,
        "token_fetch_ms": profile.token_fetch_s * 1e3,
        "link_gbps": profile.link.h2d_bytes_per_s / 1e9,
        "expert_cache_bytes": budget,
        "cache_share": min(1.0, budget / m.all_expert_bytes),
        "expert_bytes": m.expert_bytes,
        "routing": points[0].extra["routing"] if points else "",
        "acceptance": acceptance_source,
        "costs": RooflineCosts(profile).description,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "block_size": block,
        "command": "pdflash " + " ".join(sys.argv[1:]),
    }
    lines = [
        f"# {header['title']}",
        "",
        f"R = {profile.regime_ratio:.1f} (one token's experts {m.token_routed_bytes / 1e9:.2f} GB over "
        f"{header['link_gbps']:g} GB/s = {header['token_fetch_ms']:.1f} ms; AR step {header['ar_step_ms']:.2f} ms); "
        f"cache {header['cache_share']:.1%} of {m.all_expert_bytes / 1e9:.1f} GB of experts; {header['routing']}; "
        f"acceptance from {acceptance_source}; {header['costs']}; block {block}; "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens per request (simulated)",
        "",
        markdown_table(points),
    ]
    _emit(args, header, points, "\n".join(lines))
    return 0


def _pair_of(bench: dict) -> tuple[Path, Path]:
    """The report's target and drafter; the bundled pair's if the report came from another checkout."""
    from pdflash.bundled import default_drafter, default_target

    target, drafter = Path(bench["target"]), Path(bench["drafter"])
    if not target.is_dir() and target.name == default_target().name:
        bundled_drafter = default_drafter(default_target())
        if bundled_drafter is not None:
            print(f"pdflash simulate: {target} is not here; using the bundled pair it names", file=sys.stderr)
            return default_target(), bundled_drafter
    return target, drafter


def validate(args: argparse.Namespace) -> int:
    """Simulate the bundled pair (calibrated costs, replayed routing) at every closed-loop point of a bench report."""
    from pdflash.engine.async_engine import AsyncEngine

    if args.calibration is None or args.routing is None:
        raise ValueError("--validate needs --calibration (bench --calibrate) and --routing (bench --record-routing)")
    bench = json.loads(Path(args.validate).read_text())
    scale = bench["time_scale"]
    target, drafter = _pair_of(bench)
    probe = AsyncEngine.from_pretrained(target, drafter)
    spec = probe.speculator
    cfg = spec.target.config
    slot = 3 * cfg.hidden_size * cfg.moe_intermediate_size * CPU_SLOT_ITEMSIZE
    cache_bytes = int(scale["cache_fraction"] * (len(spec.expert_nbytes) * slot))  # as OffloadedExperts sizes it
    calibrated = CalibratedCosts.from_json(args.calibration)
    routed = len(cfg.moe_layer_ids) * cfg.top_k  # experts one token routes
    factor = scale["ar_step_s"] / calibrated.ar_step_s(routed) if args.compute_scale == "auto" else None
    if factor is None:
        try:
            factor = float(args.compute_scale)
        except ValueError:
            raise ValueError(f"--compute-scale={args.compute_scale!r} is neither a number nor 'auto'") from None
    costs = calibrated.scaled(factor) if factor != 1 else calibrated
    measured = [PointResult(**p) for p in bench["results"]]
    wanted = {c.name for c in parse_configs(args.configs)}
    simulated = []
    with _progress(len(measured), "simulated points", args.json == "-") as bar:
        for point in measured:
            if point.config not in wanted:
                continue
            config = CONFIGS.get(point.config) or parse_configs(point.config)[0]
            routing = TraceRouting.load(args.routing, trace_kind(config))
            budgets = point.extra.get("budgets") or {}
            setup = SimSetup(
                config=config,
                costs=costs,
                routing=routing,
                byte_map=spec.expert_nbytes,
                moe_layers=tuple(cfg.moe_layer_ids),
                top_k=cfg.top_k,
                block_size=spec.block_size,
                cache_slots=cache_bytes // slot,
                cache_bytes=cache_bytes,
                link_bytes_per_s=scale["link_gbps"] * 1e9,
                policy=bench["eviction"],
                max_num_seqs=bench["max_num_seqs"],
                budgets={k: v for k, v in budgets.items() if k.startswith("verify_")} or None,
                pipelined=not args.lock_step,
                prefill_mode=bench.get("prefill_mode", "alone"),  # reports before it was recorded prefilled alone
            )
            simulated.append(
                simulate_closed_loop(
                    setup,
                    routing.prompt_tokens(),
                    concurrency=point.concurrency,
                    requests_per_client=_requests_per_client(bench["min_requests"], point.concurrency),
                    max_tokens=bench["max_tokens"],
                )
            )
            bar.update()
    table, worst = validation_table(measured, simulated)
    header = {
        "title": "pdflash simulate --validate: the bundled pair, simulated vs measured",
        "bench": str(args.validate),
        "calibration": str(args.calibration),
        "routing": str(args.routing),
        "time_scale": scale,
        "compute_scale": factor,
        "engine_model": "lock-step" if args.lock_step else "pipelined",
        "worst_relative_error": worst,
        "command": "pdflash " + " ".join(sys.argv[1:]),
    }
    lines = [
        f"# {header['title']}",
        "",
        f"bench report {args.validate}; {header['engine_model']} engine; calibrated costs x{factor:.2f}; "
        f"worst error {worst:.1%}",
        "",
        table,
        "",
        markdown_table(simulated),
    ]
    _emit(args, header, simulated, "\n".join(lines))
    return 0
