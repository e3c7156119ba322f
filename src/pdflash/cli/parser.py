"""The `pdflash` command line's flags and dispatch: every subcommand's `--help` is written here.

Owns argument parsing and turning a UserError (or a Ctrl+C, a closed stdout, a missing
file) into one line on stderr and its exit code, and the flag value types; the commands live
in pdflash.cli.commands and pdflash.cli.serve.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pdflash
from pdflash.bench.commands import register_subcommands as register_bench_subcommands
from pdflash.chat.families import FAMILIES
from pdflash.cli.commands import cmd_generate, cmd_make_tiny, cmd_train_drafter
from pdflash.cli.errors import EXIT_BROKEN_PIPE, EXIT_FILE, EXIT_INTERRUPTED, UserError
from pdflash.cli.options import add_engine_layout_flags
from pdflash.cli.serve import API_KEY_ENV, cmd_serve
from pdflash.cli.train_route_head import register as register_train_route_head
from pdflash.spec.projection import PROJECTORS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {text}")
    return value


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, help="Hugging Face Qwen3-MoE directory (default: the built-in model)")
    p.add_argument(
        "--drafter",
        type=Path,
        help="DFlash drafter directory (default: the built-in model's; without one, decode autoregressively)",
    )
    p.add_argument("--no-spec", action="store_true", help="decode autoregressively even when a drafter is given")
    p.add_argument(
        "--speculation",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="how far each round speculates: adaptive picks each sequence's block per round by expected "
        "tokens per second of compute and link bytes (1 = plain decoding, drafter skipped); fixed always "
        "drafts the whole block (default adaptive)",
    )
    add_engine_layout_flags(p)
    p.add_argument(
        "--block-size", type=_positive_int, default=None, help="draft block size, >= 2 (default: the drafter's)"
    )
    p.add_argument(
        "--projector",
        default=None,
        choices=PROJECTORS,
        help="route projection of each drafted block (default with offloading or byte budgets: route-head "
        "when the drafter has a trained route head, else router; otherwise last-union, which costs nothing)",
    )


NO_COMPILE_ENV = "PDFLASH_NO_COMPILE"  # =1: --no-compile by default (the test suite sets it)


def _add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument(
        "--no-compile",
        action="store_true",
        default=os.environ.get(NO_COMPILE_ENV) == "1",
        help=f"run every forward eagerly: skip compiling the decode/verify/draft steps at start "
        f"(default: compile, unless ${NO_COMPILE_ENV}=1; docs/compile.md)",
    )


def _add_dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="compute dtype (default float32 on CPU, bfloat16 on a GPU that supports it)",
    )


def _add_budget_and_offload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify-token-budget",
        type=int,
        default=None,
        help="verify admission: tokens per tick (give all four budgets or none; none = token-only)",
    )
    p.add_argument("--verify-byte-budget", type=int, default=None, help="verify admission: expert bytes per tick")
    p.add_argument(
        "--verify-token-cap", type=int, default=None, help="verify admission: tokens carried at most (>= one block)"
    )
    p.add_argument(
        "--verify-byte-cap",
        type=int,
        default=None,
        help="verify admission: expert bytes carried at most (>= one block's largest union)",
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--expert-cache-bytes",
        type=int,
        default=None,
        help="offload experts to the host store behind a device cache of this many bytes",
    )
    cache.add_argument(
        "--expert-cache-fraction",
        type=float,
        default=None,
        help="offload experts behind a device cache holding this fraction of all expert bytes",
    )
    p.add_argument(
        "--eviction",
        default="activation",
        choices=["lru", "lfu", "activation"],
        help="expert cache eviction policy (default activation: recency-weighted routing history)",
    )
    p.add_argument(
        "--emulate-link-gbps",
        type=float,
        default=None,
        help="emulate a host-to-device link of this bandwidth (GB/s) on machines without a GPU",
    )


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API, the websocket stream and the demo page",
        description="Serve a model over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions "
        "(SSE streaming), /v1/models, /health, /metrics (Prometheus), the websocket /ws and the "
        "demo page at /. Stop with Ctrl+C.",
    )
    _add_model_flags(serve)
    _add_dtype_flag(serve)
    _add_device_flag(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on, 0 = any free one (default 8000)")
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: the target directory's name)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every endpoint but /health and the demo page "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="browser origins besides the server's own that may call it (CORS, websocket Origin); "
        "'*' allows any (default: same-origin only)",
    )
    serve.add_argument(
        "--max-model-len", type=_positive_int, default=None, help="prompt + max_tokens at most (default: the model's)"
    )
    serve.add_argument(
        "--max-body-bytes", type=_positive_int, default=4 * 1024 * 1024, help="HTTP body limit, 413 beyond (4 MiB)"
    )
    serve.add_argument(
        "--max-ws-message-bytes", type=_positive_int, default=1024 * 1024, help="websocket message limit (1 MiB)"
    )
    serve.add_argument(
        "--max-prompt-tokens", type=_positive_int, default=None, help="prompt tokens at most (default: the context)"
    )
    serve.add_argument(
        "--greedy", action="store_true", help="ignore generation_config.json's sampling defaults (greedy by default)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=64, help="live sequences at most (default 64)")
    serve.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests at most; one more is answered 503 (default 256)"
    )
    serve.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens of a request that gives none (default 256)"
    )
    serve.add_argument(
        "--max-ws-generations", type=int, default=32, help="concurrent generations per websocket (default 32)"
    )
    serve.add_argument(
        "--stats-interval", type=float, default=0.5, help="seconds between websocket stats messages (default 0.5)"
    )
    serve.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a jinja chat template replacing the checkpoint's (default: the checkpoint's own)",
    )
    serve.add_argument(
        "--chat-parser",
        default="auto",
        metavar="FAMILY",
        help="how chat output is parsed into reasoning_content and tool_calls: auto (from the chat template's "
        "markers) or a family: " + "; ".join(f"{f.name}: {f.summary}" for f in FAMILIES.values()),
    )
    _add_budget_and_offload_flags(serve)
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default info)",
    )
    serve.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds open requests get to finish on shutdown before they are aborted (default 5)",
    )
    _add_replica_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _add_replica_flags(serve: argparse.ArgumentParser) -> None:
    ray = serve.add_argument_group("replicas on Ray Serve (docs/ray.md; needs pip install -e '.[ray]')")
    ray.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        metavar="N",
        help="serve N engine replicas as a Ray Serve deployment behind this server (default: one engine, no Ray)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join a running Ray cluster (e.g. auto, or HEAD:6379 of `ray start --head`; default: a local instance)",
    )
    ray.add_argument(
        "--gpus-per-replica", type=float, default=0.0, metavar="G", help="Ray GPUs each replica reserves (default 0)"
    )
    ray.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        metavar="C",
        help="Ray CPUs each replica reserves; also its torch threads (default 1)",
    )
    ray.add_argument(
        "--session-field",
        default=None,
        metavar="FIELD",
        help="keep requests with the same value of this body field (e.g. user) on one replica "
        "(default: Ray Serve's power of two choices for every request)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdflash",
        description="Serve Mixture-of-Experts models with offloaded experts and DFlash speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"pdflash {pdflash.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for one prompt and stream it to stdout.",
    )
    _add_model_flags(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="new tokens at most (default 64)")
    gen.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (default: generation_config.json's, else 0)"
    )
    gen.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: as temperature)")
    gen.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = all")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding whatever generation_config.json says")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    _add_device_flag(gen)
    _add_dtype_flag(gen)
    _add_budget_and_offload_flags(gen)
    gen.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"token_ids", "text", "acceptance_lengths", "block_sizes", "stats"}',
    )
    gen.set_defaults(func=cmd_generate)

    _add_serve_parser(sub)
    register_bench_subcommands(sub)

    train = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target (writes the published DFlash layout)",
        description="Train a DFlash drafter against a frozen target: the target continues text windows from "
        "--data greedily, its tap hidden states condition the drafter, and blocks at random anchors "
        "learn to predict the continuation (position-weighted cross-entropy, AdamW, cosine schedule).",
    )
    train.add_argument(
        "--target", type=Path, required=True, help="Qwen3-MoE or gpt-oss target directory (with tokenizer.json)"
    )
    train.add_argument("--data", type=Path, nargs="+", required=True, help="text files to draw prompts from")
    train.add_argument("--out", type=Path, required=True, help="directory to write the drafter checkpoint to")
    train.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default 1)")
    train.add_argument("--block-size", type=int, default=8, help="tokens per drafted block (default 8)")
    train.add_argument(
        "--tap-layers",
        type=int,
        nargs="+",
        default=None,
        help="target layers whose hidden states condition the drafter (default: spread as published)",
    )
    train.add_argument(
        "--steps", type=int, default=2000, help="optimizer steps; the cosine schedule spans them (default 2000)"
    )
    train.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-time budget; the cosine schedule follows whichever of --steps and --minutes runs out first",
    )
    train.add_argument("--sequences", type=int, default=512, help="training sequences (default 512)")
    train.add_argument("--prompt-tokens", type=int, default=64, help="prompt window per sequence (default 64)")
    train.add_argument("--response-tokens", type=int, default=128, help="continuation per sequence (default 128)")
    train.add_argument(
        "--no-generate",
        dest="generate",
        action="store_false",
        help="train on the given text itself instead of the target's own continuations",
    )
    train.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    train.add_argument("--anchors", type=int, default=8, help="random blocks per sequence per step (default 8)")
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--data-cache",
        type=Path,
        help="keep the target's continuations and tap states in this file and reuse them while "
        "the target, data and data options are unchanged (runs that differ only in training "
        "options then skip the generation)",
    )
    train.add_argument(
        "--stats", type=Path, help="also write the training figures (steps, time, losses) to this JSON file"
    )
    train.add_argument(
        "--route-head-steps",
        type=int,
        default=0,
        help="then train a route head (the route-head projector) for that many steps on the same "
        "sequences and write route_head.safetensors beside the drafter (default 0: none; "
        "`pdflash train-route-head` trains one for an existing drafter)",
    )
    train.set_defaults(func=cmd_train_drafter)
    register_train_route_head(sub)

    tiny = sub.add_parser("make-tiny", help="write a tiny random MoE checkpoint (for tests and trials)")
    tiny.add_argument("out", help="directory to write")
    tiny.add_argument(
        "--family",
        choices=("qwen3-moe", "gpt-oss"),
        default="qwen3-moe",
        help="qwen3-moe (default) or gpt-oss (MXFP4 experts, harmony chat template)",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"pdflash: {exc}", file=sys.stderr)
        return exc.code
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        print(f"pdflash: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FILE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout's reader left: flushing at exit would raise again, so point stdout at nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
