"""What each `pdflash` subcommand does (generate, serve, train-drafter, make-tiny), and the exit codes.

A user error is one line on stderr (`pdflash: ...`) and a distinct exit code (the EXIT_*
constants, listed in docs/cli.md); Ctrl+C and a closed stdout end quietly. The flags live in
pdflash.cli.parser; bench and simulate in pdflash.bench.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import attrs

from pdflash.bundled import default_drafter, default_target
from pdflash.errors import CheckpointError
from pdflash.measure import tokens_per_second
from pdflash.sampling import SamplingParams

EXIT_USAGE = 2  # a bad flag or value (argparse's code too)
EXIT_MODEL = 3  # a checkpoint, config or generation_config that cannot be used
EXIT_FILE = 4  # a file or directory that is missing, already exists or cannot be written
EXIT_ADDRESS = 5  # serve: the host/port cannot be bound
EXIT_DEVICE = 6  # the torch device does not exist in this build / on this machine
EXIT_INTERRUPTED = 130  # Ctrl+C (128 + SIGINT), quietly
EXIT_BROKEN_PIPE = 141  # stdout closed early (`| head`; 128 + SIGPIPE), quietly
API_KEY_ENV = "PDFLASH_API_KEY"


class UserError(Exception):
    """One line for stderr and its exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


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


def _check_device(device: str) -> None:
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


def _sampling(args: argparse.Namespace, target: Path) -> SamplingParams:
    """The flags, then the target's generation_config.json, then SamplingParams' defaults (greedy)."""
    from pdflash.target.generation_config import generation_defaults

    fields = {} if args.greedy else generation_defaults(target)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.greedy:
        fields["temperature"] = 0.0
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **fields)


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(
                f"pdflash: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
    if tokenizer is None:
        raise SystemExit(f"pdflash: {args.target} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    return tokenizer.encode(args.prompt)


def _engine_options(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """Resolve the default model; read the engine settings (speculation, verify budgets) and the offload
    flags shared by generate and serve."""
    from pdflash.engine.config import VERIFY_BUDGETS

    if args.target is None:
        args.target = default_target()
        args.drafter = args.drafter or default_drafter(args.target)
    budgets = {name: getattr(args, name) for name in VERIFY_BUDGETS if getattr(args, name) is not None}
    budgets["speculation"] = args.speculation
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


def cmd_generate(args: argparse.Namespace) -> int:
    import anyio

    from pdflash.engine.async_engine import AsyncEngine

    try:
        _check_device(args.device)
        budgets, offload = _engine_options(args)
        params = _sampling(args, args.target)
        engine = AsyncEngine.from_pretrained(
            args.target,
            None if args.no_spec else args.drafter,
            block_size=args.block_size,
            projector=args.projector,
            dtype=args.dtype,
            device=args.device,
            progress=not args.json,
            max_num_seqs=1,
            offload=offload,
            **budgets,
        )
        prompt = _prompt_ids(args, engine.tokenizer)
        result = anyio.run(_generate_one, engine, prompt, params, not args.json)
    except CheckpointError as exc:
        raise UserError(str(exc), EXIT_MODEL) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
    else:
        stats = result["stats"]
        if not result["text"].endswith("\n"):
            print(flush=True)  # the output ends with a newline
        tau = f"τ {stats['mean_acceptance_length']:.2f}, " if engine.speculator.drafter else ""
        print(
            f"\n[{stats['generated_tokens']} tokens, {tau}{stats['tokens_per_second']:.1f} tokens/s, "
            f"finish: {stats['finish_reason']}]",
            file=sys.stderr,
        )
    return 0


async def _generate_one(engine, prompt: list[int], params: SamplingParams, echo: bool) -> dict:
    """One request through the engine; `echo` streams its text (or token ids) to stdout."""
    started = time.perf_counter()
    token_ids, text = [], ""
    async with engine:
        async for out in engine.generate(prompt, params):
            token_ids += out.token_ids
            text += out.text
            if echo:
                print(out.text if engine.tokenizer else "".join(f"{t} " for t in out.token_ids), end="", flush=True)
        offload_stats = engine.provider.stats() if engine.provider is not None else {}
    done = time.perf_counter()
    m = out.metrics
    first_at = started + m.ttft_s
    n = len(token_ids)
    return {
        "token_ids": token_ids,
        "text": text,
        "acceptance_lengths": list(m.acceptance_lengths),
        "block_sizes": list(m.block_sizes),
        "stats": {
            "prompt_tokens": m.prompt_tokens,
            "generated_tokens": n,
            "elapsed_s": done - started,
            "ttft_s": m.ttft_s,
            "tokens_per_second": tokens_per_second(n, first_at, done),
        }
        | (m.session_stats or {})
        | {
            "expert_bytes": m.expert_bytes,
            "fetch_bytes": m.fetch_bytes,
            "admission_wait_s": m.admission_wait_s,
            "finish_reason": out.finish_reason,
        }
        | offload_stats,
    }


def _weights_stamp(directory: Path) -> list:
    """(name, size, mtime) of a checkpoint's weight files: changes whenever the weights do."""
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.glob("*.safetensors"))]


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from pdflash.spec.train import (
        DrafterTrainer,
        TrainSettings,
        build_training_data,
        cached_training_data,
        text_prompts,
    )
    from pdflash.target.loader import load_target

    missing = [str(f) for f in args.data if not Path(f).is_file()]
    if missing:
        raise UserError(f"--data {missing[0]} is not a file (give text files to draw prompts from)", EXIT_FILE)
    try:
        settings = TrainSettings(
            num_layers=args.layers,
            block_size=args.block_size,
            steps=args.steps,
            minutes=args.minutes,
            batch_sequences=args.batch,
            anchors_per_sequence=args.anchors,
            lr=args.lr,
            seed=args.seed,
            tap_layers=args.tap_layers,
        )
        target = load_target(args.target, progress=True)
        if target.tokenizer is None:
            raise ValueError(f"{args.target} has no tokenizer.json; the trainer reads text data")
        trainer = DrafterTrainer(target, settings)
        window = args.prompt_tokens + (0 if args.generate else args.response_tokens)

        def build():
            prompts = text_prompts(target.tokenizer, args.data, count=args.sequences, length=window, seed=args.seed)
            return build_training_data(
                target,
                prompts,
                response_tokens=args.response_tokens,
                tap_layers=trainer.config.tap_layers,
                generate=args.generate,
                progress=True,
            )

        key = {
            "target": str(Path(args.target).resolve()),
            "weights": _weights_stamp(Path(args.target)),
            "data": [str(Path(f).resolve()) for f in args.data],
            "sequences": args.sequences,
            "window": window,
            "response_tokens": args.response_tokens,
            "generate": args.generate,
            "tap_layers": list(trainer.config.tap_layers),
            "seed": args.seed,
        }
        data = cached_training_data(args.data_cache, key, build)
        result = trainer.train(data, progress=True)
    except CheckpointError as exc:
        raise UserError(str(exc), EXIT_MODEL) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = trainer.save(args.out)
    tail = result.losses[-min(50, result.steps) :]
    print(
        f"wrote {out}: {result.steps} steps in {result.seconds:.0f} s, "
        f"loss {result.losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)} steps)"
    )
    if args.stats:
        args.stats.write_text(
            json.dumps(
                {
                    "steps": result.steps,
                    "elapsed_s": result.seconds,
                    "sequences": len(data.token_ids),
                    "first_loss": result.losses[0],
                    "final_loss": sum(tail) / len(tail),
                    "final_loss_steps": len(tail),
                    "losses": result.losses,
                    "settings": attrs.asdict(settings),
                },
                indent=1,
            )
        )
    return 0


def server_settings(args: argparse.Namespace):
    """ServerSettings from `pdflash serve`'s flags (after _engine_options resolved the target)."""
    from pdflash.server import ServerSettings
    from pdflash.server.limits import Limits
    from pdflash.target.generation_config import generation_defaults

    return ServerSettings(
        model_name=args.served_model_name or Path(args.target).name,
        default_max_tokens=args.default_max_tokens,
        stats_interval_s=args.stats_interval,
        max_ws_generations=args.max_ws_generations,
        max_model_len=args.max_model_len,
        limits=Limits(
            max_body_bytes=args.max_body_bytes,
            max_ws_message_bytes=args.max_ws_message_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
        ),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        allowed_origins=args.allowed_origins,
        sampling_defaults={} if args.greedy else generation_defaults(args.target),
        chat_template=args.chat_template,
        chat_parser=args.chat_parser,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pdflash.engine.async_engine import AsyncEngine
    from pdflash.server import create_app
    from pdflash.server.background import server_config
    from pdflash.server.shutdown import GracefulServer

    try:
        if args.replicas is None:
            _check_device(args.device)  # replicas check theirs: a cluster's head may have no GPU
        budgets, offload = _engine_options(args)
        settings = server_settings(args)
        engine_options = dict(
            target=args.target,
            drafter=None if args.no_spec else args.drafter,
            block_size=args.block_size,
            projector=args.projector,
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
            offload=offload,
            **budgets,
        )
        if args.replicas is not None:
            from pdflash.cli.replicas import serve_replicas

            return serve_replicas(args, settings, engine_options)
        _refuse_replica_flags(args)
        sock = _bind(args.host, args.port)
        engine = AsyncEngine.from_pretrained(
            engine_options.pop("target"), engine_options.pop("drafter"), progress=True, **engine_options
        )
        app = create_app(engine, settings)
    except CheckpointError as exc:
        raise UserError(str(exc), EXIT_MODEL) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    host, port = sock.getsockname()[:2]
    spec = "autoregressive" if engine.speculator.drafter is None else f"DFlash, block {engine.speculator.block_size}"
    key = ", API key required" if settings.api_key else ""
    print(
        f"pdflash: serving {settings.model_name!r} ({spec}{key}) on http://{host}:{port} "
        f"(demo page at /, OpenAI API under /v1, websocket at /ws, metrics at /metrics)",
        file=sys.stderr,
        flush=True,
    )
    config = server_config(app, log_level=args.log_level, timeout_graceful_shutdown=args.graceful_shutdown_timeout)
    GracefulServer(config, drain_timeout_s=args.graceful_shutdown_timeout).run(sockets=[sock])
    return 0


def _refuse_replica_flags(args: argparse.Namespace) -> None:
    """--ray-address and the per-replica flags mean nothing without --replicas."""
    flags = (
        ("--ray-address", args.ray_address, None),
        ("--gpus-per-replica", args.gpus_per_replica, 0.0),
        ("--cpus-per-replica", args.cpus_per_replica, 1.0),
        ("--session-field", args.session_field, None),
    )
    for flag, value, default in flags:
        if value != default:
            raise UserError(f"{flag} goes with --replicas N (Ray Serve replicas); add --replicas or drop {flag}")


def _bind(host: str, port: int):
    """A listening socket on host:port, before the model loads (a taken port fails fast)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_ADDRESS) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_make_tiny(args: argparse.Namespace) -> int:
    if args.family == "gpt-oss":
        from pdflash.target.tiny_gpt_oss import write_tiny_gpt_oss

        print(write_tiny_gpt_oss(Path(args.out), seed=args.seed))
        return 0
    from pdflash.target.tiny import write_tiny_target

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory; give a new or existing directory", EXIT_FILE)
    print(write_tiny_target(out, seed=args.seed))
    return 0
