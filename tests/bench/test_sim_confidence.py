"""The simulator's stand-in for the drafter's confidence, and the simulator cutting blocks with it."""

from __future__ import annotations

import pytest
from test_simulator import _zipf_point

from pdflash.bench import simulator
from pdflash.bench.sim_confidence import SimConfidence
from pdflash.spec.acceptance import CONFIDENCE_EDGES

BUCKETS = len(CONFIDENCE_EDGES) + 1


def test_accepted_drafts_are_drawn_surer_than_rejected_ones_and_the_same_for_the_same_round():
    model = SimConfidence.bundled(seed=7)
    draws = [model.draw(7, accepted, sequence, 3) for sequence in range(300) for accepted in (0, 3, 7)]
    assert all(len(d) == 7 for d in draws)
    assert model.draw(7, 3, 12, 3) == model.draw(7, 3, 12, 3) != model.draw(7, 3, 12, 4)
    sure = [c for d, accepted in zip(draws, [0, 3, 7] * 300, strict=True) for c in d[:accepted]]
    doubtful = [c for d, accepted in zip(draws, [0, 3, 7] * 300, strict=True) for c in d[accepted:]]
    # the bundled drafter: accepted drafts mostly above 0.8, rejected ones mostly below 0.5
    assert sum(sure) / len(sure) > 0.75 and sum(doubtful) / len(doubtful) < 0.45
    middles = {(lo + hi) / 2 for lo, hi in zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0), strict=True)}
    assert set(sure) | set(doubtful) <= middles


def test_one_sided_counts_are_refused():
    with pytest.raises(ValueError, match="bucket counts"):
        SimConfidence([1] * BUCKETS, [0] * BUCKETS)
    with pytest.raises(ValueError, match="bucket counts"):
        SimConfidence([1] * (BUCKETS - 1), [1] * BUCKETS)
    with pytest.raises(ValueError, match="outside 0..2"):
        SimConfidence.bundled().draw(2, 3, 0, 0)


class Recorded(SimConfidence):
    calls: list[tuple[int, int]] = []

    def draw(self, drafts, accepted, sequence, round_index):
        Recorded.calls.append((drafts, accepted))
        return super().draw(drafts, accepted, sequence, round_index)


def test_the_simulated_engine_cuts_its_greedy_drafted_blocks_by_drawn_confidences(monkeypatch):
    monkeypatch.setattr(simulator, "SimConfidence", Recorded)  # its `bundled` makes a Recorded
    Recorded.calls = []
    _zipf_point(seed=0, config="dflash-token")
    assert Recorded.calls == []  # fixed speculation is not cut
    _zipf_point(seed=0, config="adaptive")
    assert Recorded.calls and all(0 <= accepted <= drafts for drafts, accepted in Recorded.calls)
