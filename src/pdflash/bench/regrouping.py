"""A recorded routing trace regrouped: the cache accesses of schedules no engine run made.

Owns reading a `--record-routing` trace as rounds (each round's routed experts per MoE layer,
its committed tokens and, on a sequence's first round, its prefill's routes), the kinds of
speculation a trace can stand for (the recorded autoregressive and speculative runs, fixed
blocks of b, and an oracle that verifies exactly the tokens each round commits), closed-loop
clients, cohort schedules, and the accesses (pdflash.bench.paging.Access) of each batched
forward. Must not page or count: pdflash.bench.paging replays what this builds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from pdflash.bench.paging import Access
from pdflash.bench.routing import TraceRouting

Layered = list[set[int]]  # [MoE layers] experts routed at each layer


@attrs.frozen
class ReplayRound:
    """One round of a sequence, as a replay needs it."""

    routed: Layered  # what its verify routed
    committed_tokens: int
    prefill: Layered | None = None  # its sequence's prefill routes, on the sequence's first round only


KINDS = ("autoregressive", "block-2", "block-4", "speculative", "oracle")


def recorded_rounds(path: Path | str, kind: str, layers: int) -> list[list[ReplayRound]]:
    """Per recorded sequence (those with rounds), its rounds; the first carries the prefill's routes.

    "autoregressive" and "speculative" are the recorded rounds. "block-b" verifies blocks of b
    and "oracle" exactly the tokens each round commits (its recorded speculative acceptance
    length: no rejected draft, the best any choice of block lengths could do with this
    drafter); both route what the autoregressive run routed at the positions they cover and
    commit min(b, the recorded acceptance), as the simulator's adaptive replay does
    (pdflash.bench.routing.TraceRouting), until they have covered the autoregressive run.
    """
    if kind in ("autoregressive", "speculative"):
        trace = TraceRouting.load(path, kind)
        return [
            [
                ReplayRound(
                    layered(r["actual"], layers),
                    r["acceptance_length"],
                    layered(s["prefill_union"], layers) if k == 0 else None,
                )
                for k, r in enumerate(s["rounds"])
            ]
            for s in trace.sequences
            if s["rounds"]
        ]
    if kind != "oracle" and not (kind.startswith("block-") and kind.removeprefix("block-").isdigit()):
        raise ValueError(f"trace kind {kind!r} is not autoregressive, speculative, block-<b> or oracle")
    block = None if kind == "oracle" else int(kind.removeprefix("block-"))
    trace = TraceRouting.load(path, "adaptive")
    out = []
    for i, (spec, ar) in enumerate(zip(trace.sequences, trace.positional, strict=True)):
        if not spec["rounds"] or not ar["rounds"]:
            continue
        rounds: list[ReplayRound] = []
        start, k = 0, 0
        while start < len(ar["rounds"]):
            recorded = spec["rounds"][k % len(spec["rounds"])]["acceptance_length"]
            r = trace.round(i, k, recorded if block is None else block, start)
            prefill = layered(spec["prefill_union"], layers) if k == 0 else None
            rounds.append(ReplayRound(layered(r.actual, layers), r.acceptance_length, prefill))
            start, k = start + r.acceptance_length, k + 1
        out.append(rounds)
    return out


def clients(recorded: Sequence[list[ReplayRound]], n: int) -> list[list[ReplayRound]]:
    """`n` closed-loop clients: client i runs recorded sequences i, i + n, i + 2n, ... one after another."""
    return [[r for rounds in recorded[i::n] for r in rounds] for i in range(n)]


def schedule(rounds: Sequence[int], cohort: int, quantum: int) -> list[list[tuple[int, int]]]:
    """Batched forwards, each a list of (client, round index), for clients with `rounds` rounds
    each: in cohorts of `cohort` consecutive clients taking turns of `quantum` rounds
    (cohort >= len(rounds): every live client in every forward)."""
    groups = [range(i, min(len(rounds), i + cohort)) for i in range(0, len(rounds), cohort)]
    done = [0] * len(rounds)
    forwards = []
    while any(d < n for d, n in zip(done, rounds, strict=True)):
        for group in groups:
            for _ in range(quantum):
                live = [s for s in group if done[s] < rounds[s]]
                if not live:
                    break
                forwards.append([(s, done[s]) for s in live])
                for s in live:
                    done[s] += 1
    return forwards


def batch_accesses(batch: Sequence[ReplayRound], layers: int) -> list[Access]:
    """The cache requests of one batched round: the prefills of the sequences it starts (one
    forward before it, as the engine prefills before a sequence's first verify), then the round."""
    prefills = [r.prefill for r in batch if r.prefill is not None]
    parts = ([prefills] if prefills else []) + [[r.routed for r in batch]]
    return [(layer, tuple(sorted(set().union(*(r[layer] for r in part))))) for part in parts for layer in range(layers)]


def layered(pairs: Iterable[Sequence[int]], layers: int) -> Layered:
    """[layers] the experts of (layer, expert) pairs, by layer."""
    by_layer: Layered = [set() for _ in range(layers)]
    for layer, expert in pairs:
        by_layer[layer].add(expert)
    return by_layer
