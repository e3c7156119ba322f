"""What `pdflash generate` and `serve` share: the device checked, the model and its options resolved.

Owns the flags bench shares with them (`--drafter-lane`, `--prefill-mode`), turning the model, verify-budget and
offload flags into `AsyncEngine.from_pretrained`'s options (the built-in model when no
--target is given), loading the engine with them, and the check that --device exists on this
machine. Must not run the engine.
"""

from __future__ import annotations

import argparse

from pdflash.bundled import default_drafter, default_target
from pdflash.cli.errors import EXIT_DEVICE, UserError


def add_engine_layout_flags(p: argparse.ArgumentParser) -> None:
    """--drafter-lane and --prefill-mode, for every command that builds an engine."""
    from pdflash.engine.lanes import DRAFTER_LANES
    from pdflash.engine.prefill_mode import PREFILL_MODES

    layout = {
        "--drafter-lane": (
            DRAFTER_LANES,
            "where the drafter runs: a lane (thread) of its own, so sequences draft while others verify, "
            "or shared with the target, which then runs both with every torch thread; auto shares it only "
            "with experts resident on a CPU of 2-3 threads, where its own lane would halve each verify's "
            "threads (default auto; docs/engine.md)",
        ),
        "--prefill-mode": (
            PREFILL_MODES,
            "where a prompt's prefill runs: inside the next batched verify (one forward, so the experts "
            "both route to cross the link once) or alone as soon as the target frees; auto prefills inside "
            "verifies when experts are offloaded or a drafter is loaded (its first draft then joins the "
            "batch's) (default auto; docs/engine.md)",
        ),
    }
    for flag, (choices, help_text) in layout.items():
        p.add_argument(flag, choices=choices, default="auto", help=help_text)


def check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"--device {device!r} is not a torch device ({exc}); e.g. cpu or cuda") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device {device} is not available: this torch build or machine has no CUDA device; use --device cpu",
            EXIT_DEVICE,
        )


def engine_options(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """Resolve the default model; read the engine settings (speculation, verify budgets) and the offload
    flags shared by generate and serve."""
    from pdflash.engine.config import VERIFY_BUDGETS

    if args.target is None:
        args.target = default_target()
        args.drafter = args.drafter or default_drafter(args.target)
    budgets = {name: getattr(args, name) for name in VERIFY_BUDGETS if getattr(args, name) is not None}
    budgets["speculation"] = args.speculation
    budgets["drafter_lane"] = args.drafter_lane
    budgets["prefill_mode"] = args.prefill_mode
    if args.expert_cache_bytes is None and args.expert_cache_fraction is None:
        if args.emulate_link_gbps is not None:
            raise ValueError(
                "--emulate-link-gbps needs --expert-cache-bytes or --expert-cache-fraction "
                "(without offloading no expert crosses a link)"
            )
        return budgets, None
    return budgets, {
        "expert_cache_bytes": args.expert_cache_bytes,
        "expert_cache_fraction": args.expert_cache_fraction,
        "policy": args.eviction,
        "link_gbps": args.emulate_link_gbps,
    }


def load_engine(args: argparse.Namespace, budgets: dict, offload: dict | None, **options):
    """The engine the model flags name (`engine_options` resolved them), with `options` for the command."""
    from pdflash.engine.async_engine import AsyncEngine

    return AsyncEngine.from_pretrained(
        args.target,
        None if args.no_spec else args.drafter,
        block_size=args.block_size,
        projector=args.projector,
        dtype=args.dtype,
        device=args.device,
        compile=not args.no_compile,
        offload=offload,
        **options,
        **budgets,
    )
