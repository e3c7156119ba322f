"""Micro-benchmark of verify admission: admit_verify_demands over N pending demands, and the
marginal byte charge that a 2-D tick computes first (Qwen3-30B-A3B routing shapes).

    PYTHONPATH=src python benchmarks/bench_admission.py [--pending 256] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from pdflash.engine.admission import ZERO, TokensBytes, VerifyDemand, admit_verify_demands
from pdflash.engine.charging import ChargeMode, ExpertMasks, charge_bytes

LAYERS, EXPERTS, TOP_K, BLOCK = 48, 128, 8, 8  # Qwen3-30B-A3B, DFlash block of 8
EXPERT_BYTES = 9_437_184  # one bf16 expert (3 x 2048 x 768 x 2 bytes)


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def admission_cases(n: int, rng: random.Random) -> dict[str, list[VerifyDemand]]:
    mixed = [
        VerifyDemand(i, BLOCK, rng.randrange(1, 60) * EXPERT_BYTES, skipped_ticks=rng.randrange(4)) for i in range(n)
    ]
    return {
        "first-fit over a mixed line": mixed,
        "barrier at the head": [VerifyDemand("big", 4096, 10**12, skipped_ticks=4)] + mixed[1:],
        "all in flight": [VerifyDemand(i, BLOCK, EXPERT_BYTES, in_flight=True) for i in range(n)],
    }


class Pending:
    def __init__(self, union):
        self.union = union
        self.full_bytes = len(union) * EXPERT_BYTES
        self.fetch_bytes = self.full_bytes


def routed_union(rng: random.Random) -> frozenset:
    """Uniform routing of one block: BLOCK tokens x TOP_K experts in every layer."""
    return frozenset(
        (layer, e) for layer in range(LAYERS) for _ in range(BLOCK) for e in rng.sample(range(EXPERTS), TOP_K)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pending", type=int, default=256, help="pending demands per tick (default 256)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed repeats per case (default 2000)")
    parser.add_argument("--charge-repeats", type=int, default=20, help="timed repeats of the byte charge (default 20)")
    args = parser.parse_args()

    rng = random.Random(0)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()} on {platform.system()}"
    )
    budget = TokensBytes(64, 200 * EXPERT_BYTES)
    cap = TokensBytes(8192, 10**12)
    times = {}
    for name, demands in admission_cases(args.pending, rng).items():
        times[name] = median_us(lambda demands=demands: admit_verify_demands(demands, budget, ZERO, cap), args.repeats)
    base = times["first-fit over a mixed line"]
    for name, us in times.items():
        print(f"admit_verify_demands, {args.pending} pending, {name:28s}: {us:8.1f} us median  (x{us / base:.2f})")

    pending = [Pending(routed_union(rng)) for _ in range(args.pending)]
    byte_map = {(layer, e): EXPERT_BYTES for layer in range(LAYERS) for e in range(EXPERTS)}
    resident = frozenset(rng.sample(sorted(byte_map), len(byte_map) // 4))
    mean_union = statistics.mean(len(p.union) for p in pending)
    shape = f"{args.pending} pending, ~{mean_union:.0f} experts per union, 1/4 resident"
    masks = ExpertMasks(byte_map)
    unions = [masks.mask(p.union) for p in pending]
    tick_us = median_us(
        lambda: charge_bytes(pending, ChargeMode.MARGINAL, masks, resident, frozenset(), union_masks=unions),
        args.charge_repeats,
    )
    mask_us = median_us(lambda: masks.mask(pending[0].union), args.charge_repeats)
    fresh_us = median_us(
        lambda: charge_bytes(pending, ChargeMode.MARGINAL, byte_map, resident, frozenset()), args.charge_repeats
    )
    print(
        f"marginal charge of a tick, {shape}, union masks kept across ticks: {tick_us:10.1f} us median  "
        f"(x{tick_us / base:.1f} the admission)"
    )
    print(f"  one union's mask, built once when its verify is first charged:   {mask_us:10.1f} us median")
    print(f"  charge_bytes marginal (every mask built afresh):                  {fresh_us:10.1f} us median")


if __name__ == "__main__":
    main()
