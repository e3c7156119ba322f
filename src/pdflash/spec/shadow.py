"""Shadow drafts: how a greedy sequence's drafts would have been accepted, read without verifying them.

Owns checking drafts that no verify reads (`DraftResult.shadow`: the drafter drafts its whole
block in one forward, whatever prefix the round verifies) against the tokens the target goes
on to commit. For greedy decoding that is exactly what verifying them would have decided:
draft j is accepted iff it and every draft before it equal the target's tokens at their
positions, and greedy decoding commits those very tokens whatever the blocks. So a round that
verifies 2 of a drafted 8 still teaches the acceptance estimates of all 7 drafts, at no
expert bytes. Pure bookkeeping: no model, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Outcome:
    """What a checked block says, in the terms of a verify: `block` tokens, `accepted` drafts."""

    block: int  # anchor + the drafts observed (a verify of this many tokens)
    accepted: int  # drafts accepted, 0 .. block - 1


@attrs.define
class ShadowCheck:
    """The drafts of one drafted block still to be checked, in order, against committed tokens."""

    drafts: tuple[int, ...]  # drafts not yet matched or refuted, in position order
    matched: int  # drafts of the block already matched (the verified ones included)

    @classmethod
    def after_round(
        cls, verified: int, accepted: int, shadow: Sequence[int], committed: Sequence[int]
    ) -> tuple[ShadowCheck | None, Outcome | None]:
        """A round verified `verified` tokens (anchor + drafts), accepted `accepted` drafts and
        committed `committed` (its accepted drafts and the target's next token); `shadow` are the
        drafts made past the block. The check that goes on (None: nothing left to read), and the
        outcome once it is known (None: still open, or nothing to report)."""
        if not shadow or accepted < verified - 1:  # a rejected draft: the shadow drafts followed a wrong prefix
            return None, Outcome(verified, accepted) if verified >= 2 else None
        check = cls(tuple(shadow), accepted)
        return check.read(committed[accepted:])

    def read(self, committed: Sequence[int]) -> tuple[ShadowCheck | None, Outcome | None]:
        """Match the next committed tokens; the check that goes on and, once decided, the outcome."""
        matched, drafts = self.matched, self.drafts
        for token in committed:
            if token != drafts[0]:
                return None, Outcome(self.matched + len(self.drafts) + 1, matched)
            matched, drafts = matched + 1, drafts[1:]
            if not drafts:
                return None, Outcome(matched + 1, matched)
        return ShadowCheck(drafts, matched), None

    def close(self) -> Outcome | None:
        """The sequence stops reading (it drafts again, or ends): what is known so far, a block
        of the matched drafts all accepted; None when nothing was matched."""
        return Outcome(self.matched + 1, self.matched) if self.matched else None


@attrs.define
class ShadowReader:
    """One sequence's drafts as its rounds reveal them: each round's outcomes for its acceptance
    estimate (`SequenceAcceptance.record`)."""

    check: ShadowCheck | None = None  # shadow drafts still being read

    def after_round(
        self,
        *,
        drafted: bool,
        verified: int,
        accepted: int,
        shadow: Sequence[int],
        committed: Sequence[int],
        finished: bool,
    ) -> list[Outcome]:
        """A round ended: whether the drafter ran for it, the tokens it verified, the drafts it
        accepted, its shadow drafts and the tokens it committed; whether the sequence ended."""
        outcomes: list[Outcome | None] = []
        if drafted:
            if self.check is not None:  # it drafted anew: the open check ends with what it read
                outcomes.append(self.check.close())
            self.check, outcome = ShadowCheck.after_round(verified, accepted, shadow, committed)
        else:
            outcome = None
            if self.check is not None:
                self.check, outcome = self.check.read(committed)
        outcomes.append(outcome)
        if finished and self.check is not None:
            outcomes.append(self.check.close())
            self.check = None
        return [o for o in outcomes if o is not None]
