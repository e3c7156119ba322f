"""What `pdflash generate`, `train-drafter` and `make-tiny` do (serve is in pdflash.cli.serve).

Owns running one request and printing it (text, or one JSON object with --json), training
a drafter from text files with its cached training data, and writing tiny checkpoints. A
user error is a `UserError` (pdflash.cli.errors). The flags live in pdflash.cli.parser;
bench and simulate in pdflash.bench.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import attrs

from pdflash.cli.errors import EXIT_FILE, EXIT_INTERRUPTED, EXIT_MODEL, UserError
from pdflash.cli.options import check_device, engine_options, load_engine
from pdflash.errors import CheckpointError
from pdflash.measure import tokens_per_second
from pdflash.sampling import SamplingParams


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


def cmd_generate(args: argparse.Namespace) -> int:
    import anyio

    try:
        check_device(args.device)
        budgets, offload = engine_options(args)
        params = _sampling(args, args.target)
        engine = load_engine(args, budgets, offload, progress=not args.json, max_num_seqs=1)
        prompt = _prompt_ids(args, engine.tokenizer)
        result = anyio.run(_until_interrupted, _generate_one, engine, prompt, params, not args.json)
    except CheckpointError as exc:
        raise UserError(str(exc), EXIT_MODEL) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if result is None:
        return EXIT_INTERRUPTED
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


async def _until_interrupted(run, *args):
    """`await run(*args)`, or None once Ctrl+C cancelled it.

    Left to asyncio, Ctrl+C cancels the main task natively, and the signal's handler runs
    only once the main thread next runs Python; a signal received by a lane's thread then
    waits for the next event, and a native cancellation can meet anyio's cancel scopes on
    the way out (CI saw one run ignore it and finish). A signal receiver wakes the loop
    whichever thread takes the signal, and the cancellation is a plain cancel scope's.
    """
    import anyio

    result, error = None, None
    with anyio.open_signal_receiver(signal.SIGINT) as interrupts:
        async with anyio.create_task_group() as group:

            async def body() -> None:
                nonlocal result, error
                try:
                    result = await run(*args)
                except Exception as exc:  # raised as itself below, not in the group's ExceptionGroup
                    error = exc
                group.cancel_scope.cancel()

            group.start_soon(body)
            async for _ in interrupts:
                group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


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
            "drafter_lane": engine.drafter_lane,
            "prefill_mode": "verify" if engine.prefills_ride else "alone",
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
    if args.route_head_steps:
        from pdflash.cli.train_route_head import train_beside_drafter

        try:
            print(
                train_beside_drafter(
                    target, data.token_ids, out, steps=args.route_head_steps, seed=args.seed, block_size=args.block_size
                )
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
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
