"""`pdflash train-route-head` (and `train-drafter --route-head-steps`): train, score on held-out data, write.

Every 10th data file (sorted by path) is held out: the printed block score comes from those.
Beside a drafter, the drafter's own training sequences are used instead (the last tenth held out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdflash.cli.errors import EXIT_FILE, EXIT_MODEL, UserError
from pdflash.errors import CheckpointError


def register(sub) -> None:
    p = sub.add_parser(
        "train-route-head",
        help="train a route head: a drafted block's experts predicted from its tokens (route-head projector)",
        description="Run text windows through a frozen target, fit a linear map from each token's and its "
        "predecessors' embeddings to the experts every MoE layer routes it to, score the projected union of "
        "consecutive blocks on held-out files beside the previous block's union, and write the head "
        "(route_head.safetensors) into the drafter directory, where the engine finds it.",
    )
    p.add_argument("--target", type=Path, required=True, help="Qwen3-MoE or gpt-oss target directory (tokenizer.json)")
    p.add_argument("--data", type=Path, nargs="+", required=True, help="text files to draw windows from")
    p.add_argument("--out", type=Path, required=True, help="drafter directory (or a file path) to write the head to")
    p.add_argument("--sequences", type=int, default=2048, help="training windows (default 2048)")
    p.add_argument("--held-out", type=int, default=256, help="held-out windows scored (default 256)")
    p.add_argument("--window", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--context-tokens", type=int, default=3, help="a token and the ones before it (default 3)")
    p.add_argument("--threshold", type=float, default=0.3, help="union probability to project (default 0.3)")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps (default 3000)")
    p.add_argument("--block-size", type=int, default=8, help="block length scored (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--stats", type=Path, help="also write the figures (losses, held-out score) to this JSON file")
    p.set_defaults(func=cmd_train_route_head)


def _fit(target, train_windows, held_windows, settings, *, block_size: int):
    from pdflash.spec.route_training import build_route_data, score_blocks, train_route_head

    train = build_route_data(target.model, train_windows)
    held = build_route_data(target.model, held_windows)
    head, losses = train_route_head(target.model, train, settings)
    return head, losses, score_blocks(head, target.model, held, target.expert_nbytes, block_size=block_size)


def _summary(out: Path, losses, score, block_size: int) -> str:
    return (
        f"wrote {out}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out blocks of "
        f"{block_size} ({score.blocks}): coverage by bytes {score.coverage_bytes:.3f}, waste "
        f"{score.waste_bytes / 1e3:.0f} kB/block (previous block's union: {score.baseline_coverage_bytes:.3f}, "
        f"{score.baseline_waste_bytes / 1e3:.0f} kB/block)"
    )


def train_beside_drafter(target, token_ids, out_dir: Path, *, steps: int, seed: int, block_size: int) -> str:
    """A head from the drafter's training sequences ([S, L]; at most 2,304 used, the last tenth
    held out), written into the drafter directory; returns the summary line."""
    from pdflash.spec.projection import ROUTE_HEAD_FILE
    from pdflash.spec.route_training import RouteTrainSettings

    rows = token_ids[:2304].tolist()
    cut = len(rows) - max(1, len(rows) // 10)
    if cut < 1:
        raise ValueError(f"{len(rows)} training sequences leave none to hold out; give --sequences 2 at least")
    settings = RouteTrainSettings(steps=steps, seed=seed)
    head, losses, score = _fit(target, rows[:cut], rows[cut:], settings, block_size=block_size)
    return _summary(head.save(Path(out_dir) / ROUTE_HEAD_FILE), losses, score, block_size)


def cmd_train_route_head(args: argparse.Namespace) -> int:
    import attrs
    import torch

    from pdflash.spec.projection import ROUTE_HEAD_FILE
    from pdflash.spec.route_training import RouteTrainSettings
    from pdflash.spec.train import text_prompts
    from pdflash.target.loader import load_target

    torch.set_num_threads(args.threads)
    missing = [str(f) for f in args.data if not Path(f).is_file()]
    if missing:
        raise UserError(f"--data {missing[0]} is not a file (give text files to draw windows from)", EXIT_FILE)
    files = sorted(Path(f) for f in args.data)
    train_files, held_files = [f for i, f in enumerate(files) if i % 10 != 9], files[9::10]
    if not held_files:
        raise UserError(f"--data gives {len(files)} files; give 10 at least (every 10th is held out)")
    out = args.out / ROUTE_HEAD_FILE if args.out.is_dir() else args.out
    try:
        settings = RouteTrainSettings(
            context_tokens=args.context_tokens, threshold=args.threshold, steps=args.steps, seed=args.seed
        )
        target = load_target(args.target)
        if target.tokenizer is None:
            raise ValueError(f"{args.target} has no tokenizer.json; the trainer reads text data")

        def windows(fs, count, seed):
            return text_prompts(target.tokenizer, fs, count=count, length=args.window, seed=seed)

        train, held = windows(train_files, args.sequences, args.seed), windows(held_files, args.held_out, args.seed + 1)
        head, losses, score = _fit(target, train, held, settings, block_size=args.block_size)
    except CheckpointError as exc:
        raise UserError(str(exc), EXIT_MODEL) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(_summary(head.save(out), losses, score, args.block_size))
    if args.stats:
        args.stats.write_text(
            json.dumps({"score": attrs.asdict(score), "settings": attrs.asdict(settings), "losses": losses}, indent=1)
        )
    return 0
