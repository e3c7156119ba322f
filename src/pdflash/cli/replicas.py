"""`pdflash serve --replicas N`: the front server and N engine replicas on Ray Serve (docs/ray.md).

Owns the command's Ray path: checking that Ray is installed (the `ray` extra), turning the
flags into ReplicaOptions and a ReplicaSpec, and running the front under GracefulServer
inside `ray_replicas`, so SIGINT/SIGTERM drains every replica's streams and then stops
every Ray process the command started. Must not be imported on the one-engine path.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdflash.cli.errors import EXIT_USAGE, UserError
from pdflash.cli.serve import _bind


def serve_replicas(args: argparse.Namespace, settings: Any, budgets: dict, offload: dict | None) -> int:
    """Run the front and N replicas; `budgets` and `offload` as `engine_options` read them from the flags."""
    try:
        import ray  # noqa: F401  (the extra's presence, checked before anything binds or starts)
    except ImportError:
        raise UserError(
            "--replicas needs Ray Serve, which is not installed: pip install -e '.[ray]' (the ray extra)", EXIT_USAGE
        ) from None
    from pdflash.server.background import server_config
    from pdflash.server.ray_front import ReplicaFront
    from pdflash.server.ray_launch import ReplicaOptions, ray_replicas
    from pdflash.server.replica import ReplicaSpec
    from pdflash.server.shutdown import GracefulServer

    try:
        options = ReplicaOptions(
            replicas=args.replicas,
            ray_address=args.ray_address,
            cpus_per_replica=args.cpus_per_replica,
            gpus_per_replica=args.gpus_per_replica,
            session_field=args.session_field,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    sock = _bind(args.host, args.port)
    engine = dict(  # what load_engine passes: each replica loads its own engine with it
        target=args.target,
        drafter=None if args.no_spec else args.drafter,
        block_size=args.block_size,
        projector=args.projector,
        dtype=args.dtype,
        device=args.device,
        offload=offload,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        **budgets,
    )
    spec = ReplicaSpec(engine_options=engine, settings=settings)
    try:
        with ray_replicas(options, spec) as replicas:
            host, port = sock.getsockname()[:2]
            where = f"Ray cluster {options.ray_address}" if options.ray_address else "a local Ray instance"
            print(
                f"pdflash: serving {settings.model_name!r} on http://{host}:{port} through {options.replicas} "
                f"engine replicas on {where} (loading: /health answers 503 until one is ready)",
                file=sys.stderr,
                flush=True,
            )
            front = ReplicaFront(replicas, settings, session_field=options.session_field)
            config = server_config(
                front, log_level=args.log_level, timeout_graceful_shutdown=args.graceful_shutdown_timeout
            )
            GracefulServer(config, drain_timeout_s=args.graceful_shutdown_timeout).run(sockets=[sock])
    except ValueError as exc:  # no cluster at --ray-address, or it lacks the resources asked for
        raise UserError(str(exc)) from None
    return 0
