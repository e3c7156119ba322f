"""Times the grouped expert SwiGLU against the per-expert torch loop on verify-shaped batches.

On CUDA the grouped implementation is the Triton kernel (timed with CUDA events); on the CPU it
is the `grouped_mm` path that runs there (timed with the wall clock). Defaults are Qwen3-30B-A3B
experts (H=2048, I=768, 128 experts, top-8) in bfloat16 with all experts resident; the bundled
model's shapes are `--experts 32 --top-k 4 --hidden 256 --intermediate 64 --dtype fp32`.
Prints the median of the timed repeats for each token count and the speedup; `--json FILE` also
writes them (with the machine) for tools/gpu_check.sh's summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256], help="batch sizes T")
    parser.add_argument("--experts", type=int, default=128, help="number of experts E")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token K")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size H")
    parser.add_argument("--intermediate", type=int, default=768, help="expert intermediate size I")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls; the median is shown")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run (default: cuda when present)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine to this JSON file")
    return parser.parse_args(argv)


def median_ms(fn: Callable[[], None], warmup: int, repeats: int, device: torch.device) -> float:
    """Median wall time of fn in milliseconds: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU; none found")
        return 0
    torch.set_num_threads(args.threads)
    from pdflash.kernels.grouped_swiglu import grouped_swiglu_reference, grouped_swiglu_torch
    from pdflash.kernels.routing import route_reference

    if device.type == "cuda":
        from pdflash.kernels.triton_swiglu import grouped_swiglu_triton as grouped

        name, where = "triton", torch.cuda.get_device_name()
    else:
        grouped, name, where = grouped_swiglu_torch, "grouped_mm", f"CPU, {args.threads} threads"

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden, inter, experts = args.hidden, args.intermediate, args.experts
    new = dict(device=device, dtype=dtype)
    gate = torch.randn(experts, inter, hidden, **new) / hidden**0.5  # [E, I, H]
    up = torch.randn(experts, inter, hidden, **new) / hidden**0.5  # [E, I, H]
    down = torch.randn(experts, hidden, inter, **new) / inter**0.5  # [E, H, I]
    slot_of_expert = torch.arange(experts, device=device)  # [E] every expert resident
    shapes = f"E={experts} K={args.top_k} H={hidden} I={inter} {args.dtype}"
    print(f"{where}  {shapes}")
    header = ("T", 5), ("routed", 6), ("torch loop ms", 14), (f"{name} ms", 14), ("speedup", 8)
    print(" ".join(f"{label:>{width}}" for label, width in header), f"{'rel err':>9}")
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, **new)  # [T, H]
        routing = route_reference(torch.randn(tokens, experts, device=device), args.top_k, True)
        inputs = (x, routing, gate, up, down, slot_of_expert)
        want = torch.zeros(tokens, hidden, device=device)  # [T, H]
        out = torch.zeros(tokens, hidden, device=device)  # [T, H]
        grouped_swiglu_reference(*inputs, want)
        grouped(*inputs, out)
        err = (out - want).abs().max().item() / want.abs().max().item()
        timing = args.warmup, args.repeats, device
        loop_ms = median_ms(partial(grouped_swiglu_reference, *inputs, out), *timing)
        grouped_ms = median_ms(partial(grouped, *inputs, out), *timing)
        routed = routing.union_ids().numel()
        print(f"{tokens:>5} {routed:>6} {loop_ms:>14.3f} {grouped_ms:>14.3f} {loop_ms / grouped_ms:>7.2f}x {err:>9.2e}")
        rows.append(dict(tokens=tokens, routed=routed, torch_loop_ms=loop_ms, grouped_ms=grouped_ms, rel_err=err))
    if args.json is not None:
        machine = dict(device=where, torch=torch.__version__, python=platform.python_version())
        report = dict(machine=machine, grouped=name, shapes=shapes, repeats=args.repeats, rows=rows)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
