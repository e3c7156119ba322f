"""How far to speculate: the verify length b that maximises expected committed tokens per second.

Owns the pure decision of ARCHITECTURE "Deciding how far to speculate". A verify of b tokens
commits E[b] = 1 + κ·Σ_{k<b} Π_{j≤k} a_j tokens (a_j: the chance draft j is accepted given
1..j-1 were; κ: what the drafts of past rounds realized against that sum, as measured) and costs

    cost(b) = round_s + block_s(b) + [b ≥ 2]·draft_s + fetch_bytes(b) / link_bytes_per_s

where block_s(b) is the verify compute the first b tokens add to the batch (not linear in b
for a MoE target: a batch's distinct experts saturate as its tokens grow) and fetch_bytes(b)
is what their projected union adds to the experts that are resident or already coming (the
figure the scheduler charges). b = 1 is plain decoding: no drafter forward. Once a round's
drafts are made, how far to verify them is asked again (`VerifyCut`): the drafter's cost is
spent by then, and each draft's acceptance is read off the drafter's confidence in it rather
than its position's average. Everything here is a frozen value in, a frozen value out;
the estimates it is handed live in pdflash.spec.acceptance and the engine's cost model.
"""

from __future__ import annotations

import attrs

from pdflash.spec.acceptance import ConfidenceTable

SPECULATION = ("adaptive", "fixed")


@attrs.frozen(kw_only=True)
class RoundCosts:
    """What one sequence's round costs, in seconds, apart from its link bytes."""

    round_s: float  # this sequence's share of a verify's fixed cost (paid whatever b is)
    block_s: tuple[float, ...]  # [B]: verify compute the first b tokens add to the batch (b = 1 .. B)
    draft_s: float  # the drafter's forward for this sequence (b >= 2 only)
    link_bytes_per_s: float | None  # None: copies cost no time (resident, or no link to wait on)

    def __attrs_post_init__(self) -> None:
        for name in ("round_s", "draft_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not self.block_s or any(not s >= 0 for s in self.block_s):
            raise ValueError(f"block_s needs b = 1 .. B seconds, each >= 0; got {self.block_s!r}")
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 (or None), got {self.link_bytes_per_s!r}")


@attrs.frozen(kw_only=True)
class PolicyInputs:
    acceptance: tuple[float, ...]  # a_1 .. a_{B-1}: conditional acceptance of each draft position
    prefix_fetch_bytes: tuple[int, ...]  # [B]: bytes the first b tokens' union adds (b = 1 .. B)
    costs: RoundCosts
    # κ: drafts accepted / drafts the estimates expected, over recent drafted rounds (1: as estimated)
    acceptance_calibration: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not self.prefix_fetch_bytes:
            raise ValueError("prefix_fetch_bytes needs at least b = 1")
        if len(self.acceptance) != len(self.prefix_fetch_bytes) - 1:
            raise ValueError(
                f"{len(self.prefix_fetch_bytes)} block lengths need {len(self.prefix_fetch_bytes) - 1} "
                f"acceptance estimates, got {len(self.acceptance)}"
            )
        if any(not 0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"acceptance estimates are probabilities in [0, 1], got {self.acceptance}")
        if any(b < 0 for b in self.prefix_fetch_bytes):
            raise ValueError(f"prefix_fetch_bytes are sizes >= 0, got {self.prefix_fetch_bytes}")
        if not self.acceptance_calibration >= 0:
            raise ValueError(f"acceptance_calibration is a ratio >= 0, got {self.acceptance_calibration!r}")
        if len(self.costs.block_s) != len(self.prefix_fetch_bytes):
            raise ValueError(
                f"{len(self.prefix_fetch_bytes)} block lengths need as many block_s, got {len(self.costs.block_s)}"
            )

    @property
    def max_block(self) -> int:
        return len(self.prefix_fetch_bytes)


@attrs.frozen(kw_only=True)
class BlockChoice:
    block: int  # the verify length chosen (1 = plain decoding)
    expected_tokens: float  # E[committed | block]
    cost_s: float  # cost(block)
    rates: tuple[float, ...]  # [B]: expected tokens per second of each b = 1 .. B

    @property
    def tokens_per_s(self) -> float:
        return self.rates[self.block - 1]


def expected_committed(acceptance: tuple[float, ...], block: int, calibration: float = 1.0) -> float:
    """E[tokens committed by a verify of `block` tokens] = 1 + calibration · Σ_{k<block} Π_{j≤k} a_j."""
    drafts, survive = 0.0, 1.0
    for a in acceptance[: block - 1]:
        survive *= a
        drafts += survive
    return 1.0 + calibration * drafts


def round_cost_s(inputs: PolicyInputs, block: int) -> float:
    c = inputs.costs
    link_s = 0.0 if c.link_bytes_per_s is None else inputs.prefix_fetch_bytes[block - 1] / c.link_bytes_per_s
    return c.round_s + c.block_s[block - 1] + (c.draft_s if block >= 2 else 0.0) + link_s


def choose_block(inputs: PolicyInputs, shortest: int = 1) -> BlockChoice:
    """The b in shortest..B with the most expected committed tokens per second (ties: the
    shorter). `shortest` = 2: how far to verify once the drafter runs anyway."""
    if not 1 <= shortest <= inputs.max_block:
        raise ValueError(f"shortest must be a block length in 1..{inputs.max_block}, got {shortest!r}")
    rates = []
    for b in range(1, inputs.max_block + 1):
        cost = round_cost_s(inputs, b)
        expected = expected_committed(inputs.acceptance, b, inputs.acceptance_calibration)
        rates.append(expected / cost if cost > 0 else float("inf"))
    best = max(range(shortest - 1, len(rates)), key=lambda i: (rates[i], -i)) + 1
    return BlockChoice(
        block=best,
        expected_tokens=expected_committed(inputs.acceptance, best, inputs.acceptance_calibration),
        cost_s=round_cost_s(inputs, best),
        rates=tuple(rates),
    )


@attrs.frozen(kw_only=True)
class VerifyCut:
    """How far a round verifies its drafts once they are made: the policy asked again with the
    drafter's seconds spent (they no longer depend on b) and each draft's acceptance read off the
    drafter's confidence in it (`table`), at least one draft verified. On the bundled pair the
    confidence told accepted drafts from rejected ones far better than the position does (the
    chance an accepted draft was the surer of the two: 0.91), so a block is cut where the drafter
    doubts and runs on where it is sure."""

    inputs: PolicyInputs  # the round's prices and its mean estimates, as planned
    table: ConfidenceTable

    def block(self, confidence: tuple[float, ...]) -> int:
        """The verify length for drafts of these confidences (b = 2 .. 1 + len(confidence))."""
        drafted = min(len(confidence), self.inputs.max_block - 1)
        if drafted < 1:
            raise ValueError("a verify cut needs at least one draft's confidence")
        acceptance = self.table.of(confidence[:drafted]) + (0.0,) * (self.inputs.max_block - 1 - drafted)
        sunk = attrs.evolve(self.inputs.costs, draft_s=0.0)
        choice = choose_block(attrs.evolve(self.inputs, acceptance=acceptance, costs=sunk), shortest=2)
        return min(choice.block, drafted + 1)
