"""Where the simulator's expert routing comes from: traces recorded from the engine, or a stated model.

Owns the routing-trace file format (`pdflash bench --record-routing FILE`), the recorder
that fills it from a running engine's speculator, trace replay, and the Zipf model
(per-layer Zipf popularity with exponent s, per-sequence temporal locality rho). Every source
answers the same two questions: which experts a sequence's prefill routes, and for its
k-th round (a block of b tokens whose anchor is its token `start`) which experts each token
routes, which were projected (and how likely, where the projector scored them) and how many
tokens it commits. Must not touch caches, links
or scheduling.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast

import attrs
import numpy as np

from pdflash.spec.projection import Projection, routed_union
from pdflash.target.experts import ExpertKey

Union = frozenset[ExpertKey]


@attrs.frozen(kw_only=True)
class Round:
    tokens: int  # verify block length
    acceptance_length: int  # tokens committed, bonus included
    actual: Union  # experts the verify routed
    projected: Union  # experts the route projection predicted
    positions: tuple[Union, ...] = ()  # [tokens]: each token's routed experts (empty: not known)
    # the projector's P(routed) per expert (pdflash.spec.projection.Projection); None: `projected` is certain
    projected_probability: Mapping[ExpertKey, float] | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def projection(self) -> Projection:
        return Projection(self.projected, self.projected_probability)


class RoutingSource(Protocol):
    @property
    def description(self) -> str: ...

    def prefill_union(self, seq: int, prompt_tokens: int) -> Union: ...

    def round(self, seq: int, index: int, tokens: int, start: int) -> Round: ...


def _keys(pairs) -> Union:
    return frozenset((int(layer), int(expert)) for layer, expert in pairs)


def _chances(recorded: dict) -> dict[ExpertKey, float] | None:
    """A recorded round's projected probabilities ([layer, expert, p] triples), None if it has none."""
    triples = recorded.get("projected_probability")
    return None if triples is None else {(int(layer), int(e)): float(p) for layer, e, p in triples}


def _block_chances(steps: Sequence[dict[ExpertKey, float] | None]) -> dict[ExpertKey, float] | None:
    """A block's probabilities from its positions' (1 − Π (1 − p), as the route head unions a
    block); None unless every position has them."""
    if not steps or any(step is None for step in steps):
        return None
    missed: dict[ExpertKey, float] = {}
    for step in steps:
        for expert, p in cast(dict[ExpertKey, float], step).items():
            missed[expert] = missed.get(expert, 1.0) * (1.0 - p)
    return {expert: 1.0 - q for expert, q in missed.items()}


KINDS = ("autoregressive", "speculative", "adaptive")


@attrs.frozen
class TraceRouting:
    """Replays recorded sequences: simulated sequence i follows recorded sequence i mod n.

    "autoregressive" and "speculative" replay that trace's rounds in order, as recorded (full
    blocks). "adaptive" serves blocks of any length b: round k commits min(b, the recorded
    speculative round k's acceptance length) tokens, and its block routes what the recorded
    autoregressive run routed at the b positions it covers (from its anchor `start` on). Greedy
    speculative output equals autoregressive output, so that is the block's exact routing for its
    anchor and accepted drafts; a rejected draft is a different token at its position, stood in
    for by the one the target emitted there. A recorded speculative block of 8 and the
    autoregressive routes of its 8 positions overlap by 0.75 (Jaccard) on the bundled pair, with
    union sizes within 3%."""

    sequences: tuple[dict, ...]  # {"prompt_tokens", "prefill_union", "rounds": [...]} as recorded
    description: str = "replayed trace"
    positional: tuple[dict, ...] = ()  # "adaptive": the autoregressive trace's sequences, same prompts

    @classmethod
    def load(cls, path: Path | str, kind: str) -> TraceRouting:
        """The `kind` (one of KINDS) trace of a --record-routing file (.gz too)."""
        if kind not in KINDS:
            raise ValueError(f"trace kind {kind!r} is not one of {', '.join(KINDS)}")
        raw = Path(path).read_bytes()
        data = json.loads(gzip.decompress(raw) if Path(path).suffix == ".gz" else raw)
        traces = data.get("traces", {})
        needed = ("speculative", "autoregressive") if kind == "adaptive" else (kind,)
        for name in needed:
            if name not in traces or not traces[name]["sequences"]:
                raise ValueError(f"{path}: no {name!r} trace recorded (it has {sorted(traces)}); {kind!r} needs it")
        spec = tuple(traces[needed[0]]["sequences"])
        if kind != "adaptive":
            return cls(spec, f"replayed {kind} trace from {Path(path).name}")
        ar = tuple(traces["autoregressive"]["sequences"])
        if [s["prompt_ids"] for s in spec] != [s["prompt_ids"] for s in ar]:
            raise ValueError(f"{path}: its speculative and autoregressive traces ran different prompts")
        description = f"replayed trace from {Path(path).name}: speculative acceptance, autoregressive routes"
        return cls(spec, description, ar)

    def prefill_union(self, seq: int, prompt_tokens: int) -> Union:
        return _keys(self.sequences[seq % len(self.sequences)]["prefill_union"])

    def round(self, seq: int, index: int, tokens: int, start: int) -> Round:
        rounds = self.sequences[seq % len(self.sequences)]["rounds"]
        r = rounds[index % len(rounds)]
        accepted = min(tokens, r["acceptance_length"])
        if not self.positional:
            return Round(
                tokens=tokens,
                acceptance_length=accepted,
                actual=_keys(r["actual"]),
                projected=_keys(r["projected"]),
                projected_probability=_chances(r),
            )
        steps = self.positional[seq % len(self.positional)]["rounds"]  # step i verified emitted token i
        covered = [steps[min(start + j, len(steps) - 1)] for j in range(tokens)]
        positions = tuple(_keys(step["actual"]) for step in covered)
        projected = frozenset().union(*(_keys(step["projected"]) for step in covered))
        return Round(
            tokens=tokens,
            acceptance_length=accepted,
            actual=frozenset().union(*positions),
            projected=projected,
            positions=positions,
            projected_probability=_block_chances([_chances(step) for step in covered]),
        )

    def output_tokens(self, seq: int) -> int:
        """Tokens the recorded request emitted (it may have stopped before max_tokens)."""
        return 1 + sum(r["acceptance_length"] for r in self.sequences[seq % len(self.sequences)]["rounds"])

    def prompt_tokens(self) -> list[int]:
        return [s["prompt_tokens"] for s in self.sequences]

    def acceptance_lengths(self) -> list[int]:
        return [r["acceptance_length"] for s in self.sequences for r in s["rounds"]]


class ZipfRouting:
    """Per-layer Zipf popularity (exponent s, a seeded random expert order per layer); each
    token keeps the previous token's experts at a layer with probability `locality`, else
    draws top-k without replacement by popularity. Projection is taken as exact. Acceptance
    lengths replay `acceptance` (recorded rounds, in order) from a seeded offset per sequence, one
    round after another: acceptance is a property of the sequence (on the bundled pair consecutive
    rounds' lengths correlate 0.63 in the recording, 0.77 over 128-token requests), which i.i.d.
    draws would erase, and with it what a per-sequence estimate can learn. Deterministic per
    (seed, sequence).

    A sequence's committed tokens are drawn once each, in order, and every block that covers one
    routes what was drawn there: a round's anchor and accepted drafts are the committed tokens
    at their positions; its rejected drafts are other tokens, drawn afresh after them (the
    token committed at the first rejected position is the next round's anchor). So a round
    read twice (its verified prefix, and the shadow drafts of the whole block) routes its
    committed tokens and accepts the same, the next block starts from the last committed
    token, and a prompt sent again replays its routes.
    """

    def __init__(
        self,
        *,
        layers: int,
        experts: int,
        top_k: int,
        exponent: float,
        locality: float,
        acceptance: Sequence[int],
        seed: int = 0,
    ) -> None:
        if not 0.0 <= locality < 1.0:
            raise ValueError(f"routing locality must be in [0, 1), got {locality}")
        if exponent < 0:
            raise ValueError(f"Zipf exponent must be >= 0, got {exponent}")
        if not acceptance or min(acceptance) < 1:
            raise ValueError("the acceptance-length distribution must be non-empty, each length >= 1")
        self.layers, self.experts, self.top_k, self.locality, self.seed = layers, experts, top_k, locality, seed
        self.acceptance = np.asarray(acceptance, dtype=np.int64)
        order = np.random.default_rng(seed).permuted(np.tile(np.arange(experts), (layers, 1)), axis=1)
        weights = 1.0 / np.arange(1, experts + 1) ** exponent
        self.log_p = np.empty((layers, experts))  # [L, E]
        np.put_along_axis(self.log_p, order, np.log(weights / weights.sum()), axis=1)
        self.description = f"Zipf routing s={exponent:g}, locality {locality:g}, seed {seed}"
        self._state: dict[int, tuple[np.random.Generator, np.ndarray | None]] = {}
        self._prompts: dict[int, tuple[int, Union]] = {}  # sequence -> (prompt tokens, its union)
        self._offsets: dict[int, int] = {}  # sequence -> the recorded round its round 0 replays
        self._outputs: dict[int, list[np.ndarray]] = {}  # sequence -> [L, k] ids of each output position drawn
        self._drafts: dict[int, np.random.Generator] = {}  # sequence -> the draws of its rejected drafts

    def _draw(self, seq: int, n: int) -> np.ndarray:
        """[n, L, k] expert ids of the sequence's next n committed tokens (prompt, then output)."""
        rng, last = self._state.get(seq) or (np.random.default_rng((self.seed, seq)), None)
        ids = self._chain(rng, last, n)
        self._state[seq] = (rng, ids[-1] if n else last)
        return ids

    def _chain(self, rng: np.random.Generator, last: np.ndarray | None, n: int) -> np.ndarray:
        """[n, L, k] expert ids of n tokens drawn one after another, after a token that routed `last`."""
        gumbel = rng.gumbel(size=(n, self.layers, self.experts))
        fresh = np.argpartition(-(self.log_p + gumbel), self.top_k - 1, axis=-1)[..., : self.top_k]  # [n, L, k]
        keep = rng.random((n, self.layers)) < self.locality  # [n, L]
        for t in range(n):
            if last is not None:
                fresh[t][keep[t]] = last[keep[t]]
            last = fresh[t]
        return fresh

    def _union(self, ids: np.ndarray) -> Union:
        layers = np.broadcast_to(np.arange(self.layers)[None, :, None], ids.shape)
        return frozenset(zip(layers.ravel().tolist(), ids.ravel().tolist(), strict=True))

    def prefill_union(self, seq: int, prompt_tokens: int) -> Union:
        """The prompt's routed union, drawn the first time the sequence is prefilled (a prompt sent
        again routes as it did, as a greedy request for it replays its outputs' positions)."""
        if seq not in self._prompts:
            self._prompts[seq] = (prompt_tokens, self._union(self._draw(seq, prompt_tokens)))
        drawn, union = self._prompts[seq]
        if drawn != prompt_tokens:
            raise ValueError(f"sequence {seq} was prefilled with {drawn} prompt tokens, now {prompt_tokens}")
        return union

    def _positions(self, seq: int, start: int, n: int) -> list[np.ndarray]:
        """[n] of [L, k]: the expert ids at output positions start .. start + n - 1, each drawn once."""
        drawn = self._outputs.setdefault(seq, [])
        if len(drawn) < start + n:
            drawn.extend(self._draw(seq, start + n - len(drawn)))
        return drawn[start : start + n]

    def round(self, seq: int, index: int, tokens: int, start: int) -> Round:
        self._positions(seq, start, 1)  # the anchor, drawn before the sequence's acceptance offset
        if seq not in self._offsets:
            self._offsets[seq] = int(self._state[seq][0].integers(len(self.acceptance)))
        accepted = min(tokens, int(self.acceptance[(self._offsets[seq] + index) % len(self.acceptance)]))
        committed = self._positions(seq, start, accepted)  # the anchor and the accepted drafts
        drafts = self._drafts.setdefault(seq, np.random.default_rng((self.seed, seq, 1)))
        rejected = self._chain(drafts, committed[-1], tokens - accepted)
        positions = tuple(self._union(ids[None]) for ids in [*committed, *rejected])
        union = frozenset().union(*positions)
        return Round(tokens=tokens, acceptance_length=accepted, actual=union, projected=union, positions=positions)


class RoutingRecorder:
    """Records every session's prefill union and rounds from a live engine's speculator.

    It wraps three methods of that one speculator instance (the target's forward, to see each
    committed forward's routing; begin_sessions; verify_rounds); nothing else changes."""

    def __init__(self, speculator) -> None:
        self.records: dict[object, dict] = {}  # session -> its record, in order of prefill
        self._last = None
        target, layers = speculator.target, speculator.target.config.moe_layer_ids
        forward, begin, verify = target.forward, speculator.begin_sessions, speculator.verify_rounds

        def recording_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if not kwargs.get("skip_experts") and kwargs.get("commit", True):
                self._last = out
            return out

        def recording_begin(*args, **kwargs):
            sessions = begin(*args, **kwargs)
            assert self._last is not None  # begin_sessions ran one committed forward
            for s, routed in zip(sessions, self._last.split(self._last.routed), strict=True):
                self.records[s] = {
                    "prompt_ids": list(s.prompt_ids),
                    "prompt_tokens": len(s.prompt_ids),
                    "prefill_union": sorted(routed_union(routed, layers)),
                    "rounds": [],
                }
            return sessions

        def recording_verify(sessions, *args, **kwargs):
            projected = [(s.pending.expert_union, s.pending.expert_probability) for s in sessions]
            results = verify(sessions, *args, **kwargs)
            for s, (union, chances) in zip(sessions, projected, strict=True):
                trace = s.trace[-1]
                record = {
                    "tokens": trace.tokens,
                    "acceptance_length": trace.acceptance_length,
                    "actual": sorted(s.last_union),
                    "projected": sorted(union),
                }
                if chances is not None:
                    record["projected_probability"] = [[*key, round(p, 4)] for key, p in sorted(chances.items())]
                self.records[s]["rounds"].append(record)
            return results

        target.forward = recording_forward
        speculator.begin_sessions = recording_begin
        speculator.verify_rounds = recording_verify

    def sequences(self) -> list[dict]:
        """Every recorded session (one that stopped at its first token has no rounds)."""
        return list(self.records.values())


def write_traces(path: Path | str, traces: dict[str, list[dict]], meta: dict) -> None:
    """Write {"meta": ..., "traces": {kind: {"sequences": [...]}}} (kind: autoregressive | speculative),
    gzipped when `path` ends in .gz, as `TraceRouting.load` reads it."""
    body = json.dumps({"meta": meta, "traces": {kind: {"sequences": seqs} for kind, seqs in traces.items()}})
    Path(path).write_bytes(gzip.compress(body.encode()) if Path(path).suffix == ".gz" else body.encode())
