"""`pdflash serve`: the server's settings from the flags, the listening socket, and the server run.

Owns binding host:port before the model loads (a taken port fails fast), the API key from
--api-key or the PDFLASH_API_KEY environment variable, and the startup line on stderr. The
flags themselves are in pdflash.cli.parser; the server in pdflash.server.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdflash.cli.errors import EXIT_ADDRESS, EXIT_MODEL, UserError
from pdflash.cli.options import check_device, engine_options, load_engine
from pdflash.errors import CheckpointError

API_KEY_ENV = "PDFLASH_API_KEY"


def server_settings(args: argparse.Namespace):
    """ServerSettings from `pdflash serve`'s flags (after engine_options resolved the target)."""
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
    from pdflash.server import create_app
    from pdflash.server.background import server_config
    from pdflash.server.shutdown import GracefulServer

    try:
        if args.replicas is None:
            check_device(args.device)  # replicas check theirs: a cluster's head may have no GPU
        budgets, offload = engine_options(args)
        settings = server_settings(args)
        if args.replicas is not None:
            from pdflash.cli.replicas import serve_replicas

            return serve_replicas(args, settings, budgets, offload)
        _refuse_replica_flags(args)
        sock = _bind(args.host, args.port)
        engine = load_engine(
            args, budgets, offload, progress=True, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting
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
