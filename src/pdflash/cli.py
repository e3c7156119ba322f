"""The `pdflash` command line: generate, make-tiny."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdflash.sampling import SamplingParams

DEFAULT_HOME = Path(os.environ.get("PDFLASH_HOME", Path.home() / ".cache" / "pdflash"))


def default_target() -> Path:
    """The default model: a tiny random checkpoint written on first use (no download)."""
    from pdflash.tiny import write_tiny_target

    directory = DEFAULT_HOME / "tiny-random-target"
    if not (directory / "config.json").is_file():
        print(f"pdflash: writing a tiny random Qwen3-MoE checkpoint to {directory} (random weights: noise, not text)",
              file=sys.stderr)
        write_tiny_target(directory)
    return directory


def default_drafter(target: Path) -> Path:
    """A random DFlash drafter paired with the default tiny target (written on first use)."""
    from pdflash.tiny import write_tiny_drafter

    directory = DEFAULT_HOME / "tiny-random-drafter"
    if not (directory / "config.json").is_file():
        write_tiny_drafter(directory, target)
    return directory


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"pdflash: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    if tokenizer is None:
        raise SystemExit(f"pdflash: {args.target} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    return tokenizer.encode(args.prompt)


def cmd_generate(args: argparse.Namespace) -> int:
    from pdflash.drafter import load_drafter
    from pdflash.loader import load_target
    from pdflash.speculator import Speculator, speculative_generate

    if args.target is None:
        args.target = default_target()
        args.drafter = args.drafter or default_drafter(args.target)
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
            seed=args.seed,
        )
        loaded = load_target(args.target, dtype=args.dtype, progress=not args.json)
        drafter = None if args.no_spec or not args.drafter else load_drafter(args.drafter, loaded.model)
        speculator = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes,
                                projector=args.projector, block_size=args.block_size)
        prompt = _prompt_ids(args, loaded.tokenizer)
        result = speculative_generate(speculator, prompt, params)
    except ValueError as exc:
        print(f"pdflash: {exc}", file=sys.stderr)
        return 2
    text = loaded.tokenizer.decode(list(result.token_ids)) if loaded.tokenizer else ""
    if args.json:
        print(json.dumps({
            "token_ids": list(result.token_ids),
            "text": text,
            "acceptance_lengths": list(result.acceptance_lengths),
            "stats": result.stats | {"finish_reason": result.finish_reason},
        }))
    else:
        print(text if loaded.tokenizer else " ".join(map(str, result.token_ids)))
        tau = f"τ {result.stats['mean_acceptance_length']:.2f}, " if drafter else ""
        print(f"\n[{result.stats['generated_tokens']} tokens, {tau}{result.stats['tokens_per_second']:.1f} tokens/s, "
              f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from pdflash.tiny import write_tiny_target

    print(write_tiny_target(Path(args.out), seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdflash",
        description="Serve Mixture-of-Experts models with offloaded experts and DFlash speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt",
                         description="Generate a completion for one prompt and stream it to stdout.")
    gen.add_argument("--target", type=Path, help="Hugging Face Qwen3-MoE directory (default: the built-in model)")
    gen.add_argument("--drafter", type=Path,
                     help="DFlash drafter directory (default: the built-in model's; without one, decode autoregressively)")
    gen.add_argument("--no-spec", action="store_true", help="decode autoregressively even when a drafter is given")
    gen.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    gen.add_argument("--projector", default="router", choices=["router", "last-union", "exact"],
                     help="route projection of each drafted block (default router)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="compute dtype (default float32 on CPU, bfloat16 on a GPU that supports it)")
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"token_ids", "text", "acceptance_lengths", "stats"}')
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random Qwen3-MoE checkpoint (for tests and trials)")
    tiny.add_argument("out", help="directory to write")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
