"""Micro-benchmark of verify admission (Qwen3-30B-A3B routing shapes): a whole
`VerifyScheduler.tick` over N pending demands (marginal charges against resident ∪ in flight
∪ the earlier candidates, ordering, the pure admission, the hand-out), under a binding budget
of 16 blocks and 200 experts and under the engine's derived default, its parts alone
(admit_verify_demands, charge_bytes) and one union's mask, built once at registration.

    PYTHONPATH=src python benchmarks/bench_admission.py [--pending 256] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

from pdflash.engine.admission import ZERO, TokensBytes, VerifyDemand, admit_verify_demands
from pdflash.engine.charging import ChargeMode, ExpertMasks, UnionOf, charge_bytes
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.offload.slot_table import Entry, SlotTable

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


def drifting_cache(resident: frozenset, byte_map: dict, rng: random.Random) -> tuple[SlotTable, Callable[[], None]]:
    """The device cache's slot table holding `resident`, and a step that evicts 64 of its experts
    for 64 others, as a verify's fetches would."""
    table = SlotTable(len(resident), EXPERTS)
    for key in sorted(resident):
        table.add(Entry(key, table.take_free(), EXPERT_BYTES, 0.0))
    keys = sorted(byte_map)

    def drift() -> None:
        for key in rng.sample(sorted(table.entries), 64):
            table.remove(table.entries[key])
        for key in rng.sample([k for k in keys if k not in table.entries], 64):
            table.add(Entry(key, table.take_free(), EXPERT_BYTES, 0.0))

    return table, drift


def scheduler_tick_us(
    order: str,
    pending: list,
    seated: list,
    resident: frozenset,
    args,
    rng: random.Random,
    *,
    journaled: bool,
    barrier_after: int = 4,
    derived: bool = False,
) -> tuple:
    """Median µs of a first tick (fresh scheduler, after the tick that seated the running batch,
    all resident, handed the same way as every tick after it) and median and
    fastest µs of the ticks after it (64 of the cached experts evicted for others between ticks,
    admitted demands re-registered, both outside the timing), as the engine's pacer runs them. The
    resident set is the slot table's snapshot, with the bitmask the table keeps (`journaled`, what
    the device cache hands the pacer), or the same keys as a plain frozenset, compared whole.
    Demands waiting `barrier_after` ticks are guarded: they lead the line, in arrival order.
    `derived`: the engine's offloaded default budgets (every seat's block, every expert's
    bytes: every demand fits, so the tick neither ranks nor charges, and re-registrations
    build no masks) instead of 16 blocks and 200 experts a tick."""
    byte_map = {(layer, e): EXPERT_BYTES for layer in range(LAYERS) for e in range(EXPERTS)}
    seats = (len(pending) + len(seated)) * BLOCK
    every = len(byte_map) * EXPERT_BYTES
    firsts, nexts = [], []
    for _ in range(args.tick_schedulers):
        sched = VerifyScheduler(
            token_budget=seats if derived else 16 * BLOCK,
            token_cap=max(8192, seats),
            byte_budget=every if derived else 200 * EXPERT_BYTES,
            byte_cap=every if derived else 10**13,
            byte_map=byte_map,
            order=order,
            barrier_after=barrier_after,
        )
        for i, p in enumerate(seated):  # the running batch: admitted, in flight, seated every tick
            sched.register(("running", i), BLOCK, p.union, p.full_bytes, p.fetch_bytes)
        everything = drifting_cache(frozenset(byte_map), byte_map, rng)[0]
        sched.tick(everything.resident() if journaled else frozenset(byte_map))  # all resident: admitted at no bytes
        del everything
        for i in range(len(seated)):
            sched.mark_in_flight(("running", i))
        for i, p in enumerate(pending):
            sched.register(i, BLOCK, p.union, p.full_bytes, p.fetch_bytes, expected_tokens=1 + i % 5)
        in_flight = UnionOf(p.union for p in seated)
        cache, drift = drifting_cache(resident, byte_map, rng)
        for t in range(args.ticks):
            here = cache.resident() if journaled else frozenset(cache.entries)
            start = time.perf_counter()
            out = sched.tick(here, in_flight)
            (firsts if t == 0 else nexts).append(time.perf_counter() - start)
            for seq_id in out.admitted_ids:  # back in line, re-drafted: 256 pending every tick
                sched.finish(seq_id)
                sched.register(seq_id, BLOCK, pending[seq_id].union, pending[seq_id].full_bytes)
            del here
            drift()
    return statistics.median(firsts) * 1e6, statistics.median(nexts) * 1e6, min(nexts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pending", type=int, default=256, help="pending demands per tick (default 256)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed repeats per case (default 2000)")
    parser.add_argument("--charge-repeats", type=int, default=20, help="timed repeats of the byte charge (default 20)")
    parser.add_argument("--tick-schedulers", type=int, default=5, help="fresh schedulers per tick timing (default 5)")
    parser.add_argument("--ticks", type=int, default=40, help="ticks per scheduler (default 40)")
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
    mask_us = median_us(lambda: masks.mask(set(pending[0].union)), args.charge_repeats)  # a set: not memoized
    fresh_us = median_us(
        lambda: charge_bytes(pending, ChargeMode.MARGINAL, byte_map, resident, frozenset()), args.charge_repeats
    )
    print(
        f"charge_bytes marginal, {shape}, int masks kept (rows stacked per call): {tick_us:10.1f} us median  "
        f"(x{tick_us / base:.1f} the admission)"
    )
    print(f"  one union's mask, built once when its verify is registered:      {mask_us:10.1f} us median")
    print(f"  charge_bytes marginal (every mask built afresh):                  {fresh_us:10.1f} us median")

    seated = [Pending(routed_union(rng)) for _ in range(8)]
    print(
        f"VerifyScheduler.tick, {shape}, 8 running verifies seated (their union in flight), "
        f"budget {16 * BLOCK} tokens / 200 experts:"
    )
    for order in ("arrival", "yield"):
        for journaled, how in ((True, "as the device cache hands it"), (False, "plain frozenset")):
            first, nxt, fastest = scheduler_tick_us(order, pending, seated, resident, args, rng, journaled=journaled)
            print(
                f"  order {order:8s}, resident {how:28s}: first tick {first:8.1f} us median, "
                f"next ticks {nxt:8.1f} us median ({fastest:.1f} us fastest)"
            )
    # With 256 waiting and about 8 admitted a tick, most have waited past the guard: they lead the
    # line in arrival order and the first that does not fit stops it, so the yield sort is never
    # reached. Without a guard it is, every tick: the bytes every union adds alone, then a sort.
    first, nxt, fastest = scheduler_tick_us(
        "yield", pending, seated, resident, args, rng, journaled=True, barrier_after=10**9
    )
    print(
        f"  order yield   , no demand guarded (the sort runs)      : first tick {first:8.1f} us median, "
        f"next ticks {nxt:8.1f} us median ({fastest:.1f} us fastest)"
    )
    # The engine's offloaded default (derived budgets): every waiting demand fits every tick, so
    # the order and charges change nothing a tick admits, and the tick skips them (docs/engine.md).
    first, nxt, fastest = scheduler_tick_us("yield", pending, seated, resident, args, rng, journaled=True, derived=True)
    print(
        f"  order yield   , derived budgets (all {args.pending} fit)     : first tick {first:8.1f} us median, "
        f"next ticks {nxt:8.1f} us median ({fastest:.1f} us fastest)"
    )


if __name__ == "__main__":
    main()
