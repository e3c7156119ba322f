"""What the lanes run for sequences: batched prefill and drafts, and the block each draft holds.

Owns the lane-side callables of one engine (they take the sequences a lane batched and return
one result each; a verify that prompts ride prefills them in its forward), the speculation plan
asked before each draft, and how a failed batched draft is rewound so each sequence can be
retried alone. Must not touch lifecycles or scheduling.
"""

from __future__ import annotations

import time
from typing import Any

from pdflash.engine.lanes import Isolation
from pdflash.engine.sequence import Sequence
from pdflash.engine.speculation import SpeculationPlanner
from pdflash.spec.policy import VerifyCut
from pdflash.spec.session import DraftResult, SpecSession, VerifyResult
from pdflash.spec.speculator import Speculator


class RoundWork:
    def __init__(self, speculator: Speculator, planner: SpeculationPlanner) -> None:
        self.speculator, self.planner = speculator, planner
        self.prefill_s: float | None = None  # what the last batched prefill took (None before one)

    def begin_sessions(self, batch: list[Sequence]) -> list[SpecSession]:  # on the target lane
        started = time.perf_counter()
        sessions = self.speculator.begin_sessions([(s.prompt_ids, s.params) for s in batch], [s.text for s in batch])
        self.prefill_s = time.perf_counter() - started
        return sessions

    def verify_and_begin(
        self, sessions: list[SpecSession], batch: list[Sequence]
    ) -> tuple[list[VerifyResult], list[SpecSession]]:  # on the target lane
        """A batched verify with `batch`'s prompts prefilled in the same forward (pdflash.engine.prefill_mode)."""
        return self.speculator.verify_and_begin(
            sessions, [(s.prompt_ids, s.params) for s in batch], [s.text for s in batch]
        )

    def plan(self, seq: Sequence) -> int:
        """Tokens its next verify holds: the policy's choice (pdflash.engine.speculation).

        A seeded sampled request keeps the configured block: which random numbers its rounds
        draw depends on how its tokens split into rounds, and the policy's choices depend on
        timing, so only fixed blocks let the same seed give the same text again. (Greedy output
        does not depend on the split: it always equals plain decoding.)
        """
        assert seq.acceptance is not None
        if seq.params.seed is not None and not seq.params.greedy:
            return self.speculator.block_size
        return self.planner.plan(seq.acceptance, greedy=seq.params.greedy)

    def draft_tokens(self, seq: Sequence) -> int:
        """Tokens the drafter makes for its planned block (the planner's rule; 1: no drafter forward)."""
        if self.speculator.drafter is None:
            return 1
        return self.planner.drafted_tokens(seq.planned_block, greedy=seq.params.greedy)

    def cut(self, seq: Sequence) -> VerifyCut | None:
        """How its drafts are cut once made (the planner's rule; None: its planned block stands)."""
        assert seq.acceptance is not None
        if self.speculator.drafter is None or not self.cuttable(seq):
            return None
        return self.planner.cut(seq.acceptance, seq.planned_block, greedy=seq.params.greedy)

    @staticmethod
    def cuttable(seq: Sequence) -> bool:
        """Whether its drafts may be cut once made: a greedy request's always; a sampled one's when
        it has no seed (a seed's draws depend on how its tokens split into rounds) and no
        penalties (a penalized draft's q depends on the drafts drawn before it, so a cut read off
        those q would depend on the draws: pdflash.spec.speculator.Speculator.draft_rounds)."""
        params = seq.params
        return params.greedy or (params.seed is None and not params.penalized)

    def draft_rounds(self, batch: list[Sequence]) -> list[DraftResult]:  # on the drafter lane
        pairs = [(s, s.session) for s in batch if s.session is not None]
        # a session that skipped the drafter for a while first catches up on its unseen context: a
        # one-off cost, not what drafting every round costs, so such batches are not timed
        steady = all(
            session.unseen_tokens <= self.speculator.block_size for s, session in pairs if s.planned_draft >= 2
        )
        started = time.perf_counter()
        drafts = self.speculator.draft_rounds(
            [session for _, session in pairs],
            [s.planned_block for s, _ in pairs],
            [s.planned_draft for s, _ in pairs],
            [s.planned_cut for s, _ in pairs],
        )
        if steady:
            self.planner.observe_draft(sum(d.drafted for d in drafts), time.perf_counter() - started)
        return drafts


def _snapshot(seq: Sequence) -> Any:
    return seq.session.snapshot() if seq.session is not None else None


def _restore(seq: Sequence, snapshot: Any) -> None:
    if seq.session is not None and snapshot is not None:
        seq.session.restore(snapshot)


ROUND_ISOLATION: Isolation[Sequence] = Isolation(capture=_snapshot, restore=_restore)
