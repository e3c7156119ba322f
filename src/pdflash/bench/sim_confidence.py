"""The drafter's confidence in its drafts, as the simulator stands in for it.

Owns what a simulated drafted block's confidences are, so the simulator can cut blocks as the
engine does (pdflash.spec.policy.VerifyCut). A routing source replays how many of a block's
drafts were accepted, not how sure the drafter was of each; so each draft's confidence bucket
is drawn from what the bundled pair's drafter showed for drafts the target accepted, or
rejected (`confidence.json`, measured by benchmarks/bench_confidence.py), and its confidence
is that bucket's middle (the cut reads only buckets). Drafts after the first rejected one are
drawn as rejected ones: they follow a wrong token. The draws assume a draft's confidence
depends only on its own verdict, and that another pair's drafter is as sure of its drafts as
the bundled one: both are modelling assumptions, stated with the results.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np

from pdflash.spec.acceptance import CONFIDENCE_EDGES


class SimConfidence:
    def __init__(self, accepted: list[int], rejected: list[int], seed: int = 0) -> None:
        buckets = len(CONFIDENCE_EDGES) + 1
        if len(accepted) != buckets or len(rejected) != buckets or sum(accepted) <= 0 or sum(rejected) <= 0:
            raise ValueError(f"need {buckets} bucket counts of accepted and of rejected drafts, each summing above 0")
        self._accepted = np.asarray(accepted, dtype=float) / sum(accepted)  # [buckets] P(bucket | accepted)
        self._rejected = np.asarray(rejected, dtype=float) / sum(rejected)  # [buckets] P(bucket | rejected)
        lows, highs = (0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0)
        self._middles = np.array([(lo + hi) / 2 for lo, hi in zip(lows, highs, strict=True)])
        self.seed = seed

    @classmethod
    def bundled(cls, seed: int = 0) -> SimConfidence:
        """The bundled pair's measurement (confidence.json)."""
        data = json.loads(resources.files("pdflash.bench").joinpath("confidence.json").read_text())
        if tuple(data["edges"]) != CONFIDENCE_EDGES:
            raise ValueError("confidence.json was measured over other buckets than CONFIDENCE_EDGES")
        return cls(data["accepted"], data["rejected"], seed)

    def draw(self, drafts: int, accepted: int, sequence: int, round_index: int) -> tuple[float, ...]:
        """[drafts]: the confidences of a drafted block whose first `accepted` drafts the target
        accepts; the same for the same (seed, sequence, round) whatever order events run in."""
        if not 0 <= accepted <= drafts:
            raise ValueError(f"accepted={accepted} is outside 0..{drafts}")
        rng = np.random.default_rng((self.seed, sequence, round_index, 2))
        n = len(self._middles)
        sure = rng.choice(n, size=accepted, p=self._accepted)
        doubtful = rng.choice(n, size=drafts - accepted, p=self._rejected)
        return tuple(self._middles[np.concatenate([sure, doubtful])].tolist())
