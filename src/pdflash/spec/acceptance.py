"""Online per-position acceptance estimates: per sequence, shrunk toward a global prior.

Owns what the speculation policy believes about a_k, the chance that draft k is accepted
given drafts 1..k-1 were. A verify of b tokens that accepted n drafts is one trial at each
position k ≤ min(n + 1, b - 1) and a success at each k ≤ n. A sequence's counts decay per
round, observed or not, so a sequence that stopped speculating drifts back to the pooled
estimate: after a run of rejections the policy backs off, and it probes again later, so it
recovers when acceptance returns. The pooled counts decay per drafted round (they forget as
they learn): with nobody drafting, the estimate keeps what it knew.

The policy decides on a draw (`SequenceAcceptance.draw`), not on the mean: Thompson sampling
over the pooled estimate's posterior. While few rounds have drafted, draws spread and the
policy probes the blocks that might pay; as observations accumulate they narrow onto the mean,
and where even a generous draw cannot make a draft pay (a slow link at one sequence) it stops
probing altogether. Deciding on the mean instead left the policy where its first few probes put
it: below the break-even it never drafted again to learn otherwise (resident, concurrency 1:
plain decoding at 0.79x the whole block's tokens/s). The sequences that plan between two
verifies decide on one draw (`AcceptanceModel.next_draw`): alike, they decide alike.

Once a block is drafted, what each of its drafts is worth is read instead off the drafter's
confidence in it (`ConfidenceCalibration`, pooled over sequences and positions, one for argmax
drafts and one for drawn ones): the acceptance a cut of the block is decided on
(pdflash.spec.policy.VerifyCut).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

import attrs

_TINY = 1e-9  # a Beta parameter's floor (a position whose every trial succeeded, behind a prior of 1)


@attrs.frozen(kw_only=True)
class AcceptancePrior:
    prior: float = 0.6  # a_k believed before anything is observed
    prior_weight: float = 16.0  # pseudo-trials behind `prior` in the global estimate
    shrink_weight: float = 3.0  # pseudo-trials of the global estimate behind each sequence's
    sequence_decay: float = 0.8  # per round: a sequence's counts fade within a few rounds
    global_decay: float = 0.995  # per drafted round of any sequence: the last ~200 drafted rounds

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior is a probability in [0, 1], got {self.prior!r}")
        for name in ("prior_weight", "shrink_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 pseudo-trials, got {getattr(self, name)!r}")
        for name in ("sequence_decay", "global_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a factor in (0, 1], got {getattr(self, name)!r}")


@attrs.define
class _Counts:
    trials: list[float]  # [B-1] decayed trials per draft position
    successes: list[float]  # [B-1] decayed acceptances per draft position

    @classmethod
    def empty(cls, positions: int) -> _Counts:
        return cls([0.0] * positions, [0.0] * positions)

    def decay(self, factor: float) -> None:
        self.trials = [t * factor for t in self.trials]
        self.successes = [s * factor for s in self.successes]

    def observe(self, block: int, accepted_drafts: int) -> None:
        for k in range(min(accepted_drafts + 1, block - 1, len(self.trials))):
            self.trials[k] += 1.0
            self.successes[k] += 1.0 if k < accepted_drafts else 0.0

    def shrunk(self, toward: tuple[float, ...], weight: float) -> tuple[float, ...]:
        return tuple((s + weight * g) / (t + weight) for s, t, g in zip(self.successes, self.trials, toward))


class AcceptanceModel:
    """The global estimate, and one tracker per sequence (`for_sequence`)."""

    def __init__(self, max_block: int, prior: AcceptancePrior | None = None, seed: int = 0) -> None:
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block!r}")
        self.prior = prior or AcceptancePrior()
        self.positions = max_block - 1
        self._global = _Counts.empty(self.positions)
        self._rng = random.Random(seed)  # the draws: one seed, the same decisions for the same observations
        self._draw: tuple[float, ...] | None = None  # [B-1]: the draw of this round of planning, once drawn
        self._estimate: tuple[float, ...] | None = None  # [B-1]: `global_estimate` since the last observation

    def global_estimate(self) -> tuple[float, ...]:
        """[B-1]: the pooled estimate. Position 1 is shrunk toward the prior, each later one toward
        the estimate before it: a position no round has reached yet is believed to accept as the
        last one observed does (short blocks never see the later positions at all)."""
        if self._estimate is None:
            self._estimate = self._pooled()
        return self._estimate

    def _pooled(self) -> tuple[float, ...]:
        out: list[float] = []
        toward = self.prior.prior
        for s, t in zip(self._global.successes, self._global.trials, strict=True):
            toward = (s + self.prior.prior_weight * toward) / (t + self.prior.prior_weight)
            out.append(toward)
        return tuple(out)

    def next_draw(self) -> None:
        """A new round of planning: the sequences that plan from now on decide on a new draw.

        Every sequence planning between two verifies decides on the same draw of the pooled
        estimate (behind its own counts). The policy prices a block as if the batch's other
        sequences chose as this one does, and with one draw each, sequences alike split at
        random into drafting and plain halves whenever the two choices' rates are close: each
        half pays its own verifies and drafter calls, and the mix ran slower than either choice
        alone (resident, c = 4: adaptive 588 tok/s, plain 760, blocks of 8 668)."""
        self._draw = None

    def global_draw(self) -> tuple[float, ...]:
        """[B-1]: this round of planning's draw from the pooled estimate's posterior (drawn at the
        first call after `next_draw`): each position a Beta over its decayed successes and failures
        behind `prior_weight` pseudo-trials of the draw before it (position 1: of the prior). Its
        mean is `global_estimate`; its spread shrinks as trials accumulate."""
        if self._draw is None:
            self._draw = self._new_draw()
        return self._draw

    def _new_draw(self) -> tuple[float, ...]:
        out: list[float] = []
        toward = self.prior.prior
        w = self.prior.prior_weight
        for s, t in zip(self._global.successes, self._global.trials, strict=True):
            alpha, beta = s + w * toward, (t - s) + w * (1.0 - toward)
            toward = self._rng.betavariate(max(alpha, _TINY), max(beta, _TINY))
            out.append(toward)
        return tuple(out)

    def for_sequence(self) -> SequenceAcceptance:
        return SequenceAcceptance(self)

    def _observe(self, block: int, accepted_drafts: int) -> None:
        if block >= 2:  # it forgets as it learns: with nobody drafting, it keeps what it knew
            self._global.decay(self.prior.global_decay)
            self._global.observe(block, accepted_drafts)
            self._estimate = None


class SequenceAcceptance:
    """One sequence's estimate: its own decayed counts behind `shrink_weight` of the global one."""

    def __init__(self, model: AcceptanceModel) -> None:
        self._model = model
        self._counts = _Counts.empty(model.positions)

    def estimate(self) -> tuple[float, ...]:
        """[B-1]: a_1 .. a_{B-1} for this sequence's next round."""
        return self._counts.shrunk(self._model.global_estimate(), self._model.prior.shrink_weight)

    def draw(self) -> tuple[float, ...]:
        """[B-1]: what the policy decides on: this sequence's counts behind a draw of the pooled estimate."""
        return self._counts.shrunk(self._model.global_draw(), self._model.prior.shrink_weight)

    def observe(self, block: int, accepted_drafts: int) -> None:
        """A round verified `block` tokens and accepted `accepted_drafts` of its drafts (b = 1: none to see)."""
        self.round_passed()
        self.record(block, accepted_drafts)

    def round_passed(self) -> None:
        """A round of this sequence ended: its own counts fade."""
        self._counts.decay(self._model.prior.sequence_decay)

    def record(self, block: int, accepted_drafts: int) -> None:
        """`block` tokens' drafts were found accepted as `accepted_drafts` (by a verify, or by
        checking shadow drafts against the tokens committed after them: pdflash.spec.shadow)."""
        if not 0 <= accepted_drafts <= max(0, block - 1):
            raise ValueError(f"accepted_drafts={accepted_drafts} is outside 0..{block - 1} for a block of {block}")
        if block >= 2:
            self._counts.observe(block, accepted_drafts)
        self._model._observe(block, accepted_drafts)


# A draft's confidence is the peak of the drafter's distribution at its position (greedy: the
# probability of the argmax it drafted; sampled: of q's likeliest token). Buckets by confidence,
# bounded above by these edges (the last bucket runs to 1): on the bundled pair the greedy drafts
# of confidence below 0.2 were accepted 15% of the time, those above 0.95 99%; drawn drafts at
# T = 0.7, 16% below 0.3 and 75% above 0.99.
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
CONFIDENCE_PRIOR_WEIGHT = 8.0  # pseudo-trials behind each bucket's prior (its own middle: calibrated)
CONFIDENCE_DECAY = 0.999  # per observed draft: the last ~1,000 drafts


def _bucket_middles() -> tuple[float, ...]:
    lows, highs = (0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0)
    return tuple((lo + hi) / 2 for lo, hi in zip(lows, highs, strict=True))


@attrs.frozen
class ConfidenceTable:
    """What a draft of each confidence is believed to be accepted as (given the drafts before it were)."""

    acceptance: tuple[float, ...]  # [len(CONFIDENCE_EDGES) + 1]: per confidence bucket

    def of(self, confidence: Sequence[float]) -> tuple[float, ...]:
        """[d]: the chance each draft is accepted, its predecessors accepted, read off its confidence."""
        return tuple(self.acceptance[bisect.bisect_right(CONFIDENCE_EDGES, c)] for c in confidence)


class ConfidenceCalibration:
    """Acceptance by the drafter's confidence, learned online from verified drafts.

    A verify that accepted n of its drafts is a trial of every draft up to the first rejected
    one (a success for the first n), each in its confidence's bucket. Each bucket starts out
    believing a draft is accepted as often as the drafter is sure of it (its middle, behind
    CONFIDENCE_PRIOR_WEIGHT pseudo-trials), and the counts decay per draft observed. Decay is
    kept as the weight of the newest draft (each one weighs 1 / CONFIDENCE_DECAY times the one
    before), so a draft costs one addition on the event loop, not a pass over the buckets."""

    def __init__(self) -> None:
        self._prior = _bucket_middles()
        self._trials = [0.0] * len(self._prior)  # weighted: in units of the newest draft's weight
        self._successes = [0.0] * len(self._prior)
        self._weight = 1.0  # the newest draft's weight; the counts over it are the decayed counts
        self._table: ConfidenceTable | None = None

    def table(self) -> ConfidenceTable:
        if self._table is None:
            w, scale = CONFIDENCE_PRIOR_WEIGHT, 1.0 / self._weight
            self._table = ConfidenceTable(
                tuple(
                    (s * scale + w * p) / (t * scale + w)
                    for s, t, p in zip(self._successes, self._trials, self._prior, strict=True)
                )
            )
        return self._table

    def observe(self, confidence: Sequence[float], accepted_drafts: int) -> None:
        """A verify read the drafts of these confidences (in order) and accepted `accepted_drafts`."""
        for k, c in enumerate(confidence[: accepted_drafts + 1]):
            self._weight /= CONFIDENCE_DECAY
            bucket = bisect.bisect_right(CONFIDENCE_EDGES, c)
            self._trials[bucket] += self._weight
            self._successes[bucket] += self._weight if k < accepted_drafts else 0.0
        if self._weight > 1e100:  # rescale before the weights overflow: the counts are unchanged
            self._trials = [t / self._weight for t in self._trials]
            self._successes = [s / self._weight for s in self._successes]
            self._weight = 1.0
        self._table = None
