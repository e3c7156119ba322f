"""Times gpt-oss's expert MLP with MXFP4 experts (dequantized at compute) against the same experts dense.

One layer of `kernels.clamped_swiglu.clamped_swiglu_reference`, the torch path gpt-oss experts
take off CUDA, at gpt-oss-20b's expert shape (H = I = 2880, 32 experts, top-4) by
default, in float32 on the CPU. Both sides compute the same routed experts; the MXFP4 side
reads a quarter of the bytes and pays the unpacking. Prints the medians side by side and
their ratio, and the bytes each side reads per routed expert.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from pdflash.kernels.clamped_swiglu import clamped_swiglu_reference
from pdflash.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from pdflash.kernels.routing import permutation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="batch sizes T")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls; the median is shown")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args(argv)


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator().manual_seed(0)
    gu_blocks, gu_scales = pack_mxfp4(torch.randn(E, 2 * I, H, generator=g) * 0.02)  # [E, 2I, H/32, 16]
    dn_blocks, dn_scales = pack_mxfp4(torch.randn(E, H, I, generator=g) * 0.02)  # [E, H, I/32, 16]
    gu_dense, dn_dense = (
        unpack_mxfp4(gu_blocks, gu_scales, torch.float32),
        unpack_mxfp4(dn_blocks, dn_scales, torch.float32),
    )
    gu_bias, dn_bias = torch.zeros(E, 2 * I), torch.zeros(E, H)
    slots = torch.arange(E)
    mx_bytes = (gu_blocks.nbytes + gu_scales.nbytes + dn_blocks.nbytes + dn_scales.nbytes) // E
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads"
    )
    print(
        f"experts: H={H} I={I} E={E} top-{K}; bytes read per routed expert: MXFP4 {mx_bytes:,}, fp32 {(gu_dense.nbytes + dn_dense.nbytes) // E:,}"
    )
    print(f"{'T':>4} {'routed':>6} {'mxfp4 ms':>9} {'dense ms':>9} {'mxfp4/dense':>11}")
    for T in args.tokens:
        x = torch.randn(T, H, generator=g)
        logits = torch.randn(T, E, generator=g)
        top, ids = torch.topk(logits, K, dim=-1)
        routing = permutation(ids, torch.softmax(top, dim=-1), E)

        def run(gate_up, gate_up_scales, down, down_scales, x=x, routing=routing):
            out = torch.zeros(x.shape)
            clamped_swiglu_reference(
                x,
                routing,
                gate_up,
                gate_up_scales,
                gu_bias,
                down,
                down_scales,
                dn_bias,
                slots,
                out,
                limit=7.0,
                alpha=1.702,
            )

        mx = median_s(lambda: run(gu_blocks, gu_scales, dn_blocks, dn_scales), args.repeats)
        dense = median_s(lambda: run(gu_dense, None, dn_dense, None), args.repeats)
        routed = int(routing.union_mask.sum())
        print(f"{T:>4} {routed:>6} {mx * 1e3:>9.1f} {dense * 1e3:>9.1f} {mx / dense:>11.2f}")


if __name__ == "__main__":
    main()
