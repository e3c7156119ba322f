"""Does the speculation policy get what it expects? Its per-round predictions beside what the rounds realized.

Behind a profile's emulated link, each configuration runs once per repeat (`lane_timeline.py`'s
closed-loop run: fresh engine, the bundled pair, greedy HumanEval headers). Every block the
planner chooses is recorded with what the mean estimate expected of it when it was chosen:
committed tokens (E, calibrated), the bytes its positions add (the prefix price) and its
rate against plain decoding's; every verified round with what it committed (τ) and the bytes
its positions added (`RoundTrace.position_fetch_bytes`). Printed per block length: planned
rounds and their means, verified rounds and theirs; and per run the bytes the cache fetched
per committed token: on demand (misses), prefetched, and of those evicted unused. A plain
round's bytes that rise in the runs that draft more are a cost the drafted blocks put on
the rounds after them, which no price holds.

    python benchmarks/policy_calibration.py --configs adaptive --concurrency 4 --repeats 4
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
from collections.abc import Iterator

from lane_timeline import report, sweep, sweep_options

from pdflash.engine.speculation import SpeculationPlanner
from pdflash.spec.policy import choose_block, expected_committed


@contextlib.contextmanager
def recorded(planned: dict[int, list[tuple]], verified: dict[int, list[tuple]]) -> Iterator[None]:
    """Every planner's choices into `planned` and verified rounds into `verified`, by block length."""
    plan, observe_verify = SpeculationPlanner.plan, SpeculationPlanner.observe_verify

    def planning(self, acceptance, *, greedy=False):
        block = plan(self, acceptance, greedy=greedy)
        if self.adaptive and (mean := self.inputs(acceptance)) is not None:
            expected = expected_committed(mean.acceptance, block, mean.acceptance_calibration)
            rates = choose_block(mean).rates
            planned[block].append((expected, mean.prefix_fetch_bytes[block - 1], rates[block - 1] / rates[0]))
        return block

    def observing(self, traces, compute_s, experts=0):
        for t in traces:
            if t.position_fetch_bytes:
                verified[t.tokens].append((t.acceptance_length, sum(t.position_fetch_bytes)))
        return observe_verify(self, traces, compute_s, experts)

    SpeculationPlanner.plan, SpeculationPlanner.observe_verify = planning, observing
    try:
        yield
    finally:
        SpeculationPlanner.plan, SpeculationPlanner.observe_verify = plan, observe_verify


def mean_of(rows: list[tuple], column: int) -> float:
    return statistics.mean(row[column] for row in rows) if rows else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep_options(parser, configs="adaptive", concurrency=[4], repeats=2)
    for name, concurrency, one in sweep(parser.parse_args()):
        planned: dict[int, list[tuple]] = collections.defaultdict(list)
        verified: dict[int, list[tuple]] = collections.defaultdict(list)
        with recorded(planned, verified):
            seen = one()
        print(report(name, concurrency, seen), flush=True)
        tokens = sum(len(v) * mean_of(v, 0) for v in verified.values())
        cache = seen["offload"]
        print(
            f"  fetched per token committed: {cache['miss_bytes'] / tokens / 1e3:.0f} kB on demand, "
            f"{cache['prefetch_bytes'] / tokens / 1e3:.0f} kB prefetched, of them "
            f"{cache['prefetch_waste_bytes'] / tokens / 1e3:.0f} kB evicted unused",
            flush=True,
        )
        for block in sorted(set(planned) | set(verified)):
            p, v = planned.get(block, []), verified.get(block, [])
            print(
                f"  b={block}: planned {len(p)}, expected {mean_of(p, 0):.2f} tokens, "
                f"{mean_of(p, 1) / 1e3:.0f} kB, rate / plain {mean_of(p, 2):.3f} | verified {len(v)}, "
                f"τ {mean_of(v, 0):.2f}, {mean_of(v, 1) / 1e3:.0f} kB",
                flush=True,
            )


if __name__ == "__main__":
    main()
