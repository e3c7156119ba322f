"""Where a point's expert bytes go: target forwards that verify, that prefill, and that do both.

Runs `pdflash bench` configurations (offloaded, behind the profile's emulated link) as closed
loops and counts, for each kind of target forward, the calls, the prompts and verified
sequence-rounds in them, and the expert bytes the cache fetched while they ran: every
verify and prefill goes through `Speculator.verify_and_begin`, which this script wraps.
Copies run on the cache's own thread, so a forward's bytes include the route-ahead
prefetches of the next batch that ran meanwhile; the kinds sum to about the point's total
(what falls between forwards is listed as "between"). The question it answers: when a
speculative configuration fetches more bytes per token than plain decoding, is it the
verifies or the prefills? (docs/engine.md, "Prefills inside verifies".)

    python benchmarks/bytes_by_call.py --configs ar,dflash-token,adaptive --concurrency 16 --min-requests 64
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from pdflash.bench.configs import parse_configs
from pdflash.bench.report import machine
from pdflash.bench.runner import add_linked_run_options, engine_recipe, linked_run, run_point
from pdflash.engine.async_engine import AsyncEngine
from pdflash.sampling import SamplingParams

KINDS = ("verify", "prefill", "both")


class CallBytes:
    """Wraps an engine's `Speculator.verify_and_begin`: per kind of forward, what ran and what was fetched."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.prompts: Counter[str] = Counter()
        self.rounds: Counter[str] = Counter()
        self.fetched: Counter[str] = Counter()  # bytes

    def install(self, engine: AsyncEngine) -> None:
        provider, real = engine.provider, engine.speculator.verify_and_begin
        assert provider is not None, "an offloaded configuration has a provider"

        def fetched() -> int:
            return int(provider.stats().get("expert_bytes_fetched", 0))

        def counted(sessions: Any, requests: Any, watchers: Any = None) -> Any:
            kind = "both" if sessions and requests else "verify" if sessions else "prefill"
            before = fetched()
            try:
                return real(sessions, requests, watchers)
            finally:
                self.calls[kind] += 1
                self.prompts[kind] += len(requests)
                self.rounds[kind] += len(sessions)
                self.fetched[kind] += fetched() - before

        engine.speculator.verify_and_begin = counted  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linked_run_options(parser, configs="ar,dflash-token,adaptive", concurrency=[16], min_requests=64, threads=2)
    args = parser.parse_args()

    configs = [c for c in parse_configs(args.configs) if c.offloaded]
    run = linked_run(args, configs)
    plan, scale, pool = run.plan, run.scale, run.pool
    recipe = engine_recipe(plan, scale)
    params = SamplingParams(max_tokens=args.max_tokens)
    print(f"machine: {machine()}; bundled pair, {scale.describe()}")
    print("| config | c | tok/s | τ | kB/token | forward | calls | prompts | sequence-rounds | MB fetched | kB/token |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for c in args.concurrency:
        for config in configs:
            counts = CallBytes()
            point = run_point(
                recipe.build(plan, config),
                config,
                pool,
                params,
                concurrency=c,
                requests_per_client=plan.requests_per_client(c),
                recorder=counts.install,
            )
            total = point.bytes_per_token * point.tokens
            head = f"| {config.name} | {c} | {point.tokens_per_s:.1f} | {point.tau:.2f} | {point.bytes_per_token / 1e3:,.0f}"
            rows = [(k, counts.calls[k], counts.prompts[k], counts.rounds[k], counts.fetched[k]) for k in KINDS]
            rows.append(("between", 0, 0, 0, total - sum(counts.fetched.values())))
            for kind, calls, prompts, rounds, nbytes in rows:
                print(
                    f"{head} | {kind} | {calls} | {prompts} | {rounds} | {nbytes / 1e6:.1f} | "
                    f"{nbytes / point.tokens / 1e3:,.0f} |",
                    flush=True,
                )
                head = "| | | | |"


if __name__ == "__main__":
    main()
