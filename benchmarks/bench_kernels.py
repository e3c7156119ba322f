"""Times the grouped Triton SwiGLU against the per-expert torch loop on verify-shaped batches.

Defaults are Qwen3-30B-A3B experts (H=2048, I=768, 128 experts, top-8) in bfloat16, with all
experts resident; prints the median of the timed repeats (CUDA events) for each token count and
the speedup. Needs a CUDA GPU; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial

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
    return parser.parse_args(argv)


def median_ms(fn: Callable[[], None], warmup: int, repeats: int) -> float:
    """Median wall time of fn on the current stream, in milliseconds, from CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU; none found")
        return 0
    from kernels.grouped_swiglu import grouped_swiglu_reference
    from kernels.routing import route_reference
    from kernels.triton_swiglu import grouped_swiglu_triton

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    hidden, inter, experts = args.hidden, args.intermediate, args.experts
    new = dict(device=device, dtype=dtype)
    gate = torch.randn(experts, inter, hidden, **new) / hidden**0.5  # [E, I, H]
    up = torch.randn(experts, inter, hidden, **new) / hidden**0.5  # [E, I, H]
    down = torch.randn(experts, hidden, inter, **new) / inter**0.5  # [E, H, I]
    slot_of_expert = torch.arange(experts, device=device)  # [E] every expert resident
    shapes = f"E={experts} K={args.top_k} H={hidden} I={inter} {args.dtype}"
    print(f"{torch.cuda.get_device_name()}  {shapes}")
    header = ("T", 5), ("routed", 6), ("torch loop ms", 14), ("triton ms", 10), ("speedup", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'rel err':>9}")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, **new)  # [T, H]
        routing = route_reference(torch.randn(tokens, experts, device=device), args.top_k, True)
        inputs = (x, routing, gate, up, down, slot_of_expert)
        want = torch.zeros(tokens, hidden, device=device)  # [T, H]
        out = torch.zeros(tokens, hidden, device=device)  # [T, H]
        grouped_swiglu_reference(*inputs, want)
        grouped_swiglu_triton(*inputs, out)
        err = (out - want).abs().max().item() / want.abs().max().item()
        timing = args.warmup, args.repeats
        loop_ms = median_ms(partial(grouped_swiglu_reference, *inputs, out), *timing)
        triton_ms = median_ms(partial(grouped_swiglu_triton, *inputs, out), *timing)
        routed = routing.union_ids().numel()
        print(
            f"{tokens:>5} {routed:>6} {loop_ms:>14.3f} {triton_ms:>10.3f} "
            f"{loop_ms / triton_ms:>7.2f}x {err:>9.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
