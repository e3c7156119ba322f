"""The engine's side of "how far to speculate": live estimates in, one block length per round out.

Owns the estimates the pure policy (pdflash.spec.policy) is fed: each sequence's acceptance
(pdflash.spec.acceptance), the bytes each further block position adds on the link (measured by
every verify: RoundTrace.position_fetch_bytes), and what a round costs in compute (a verify's
fixed and per-token seconds, fitted online from batched verifies; the drafter's seconds per
sequence). `speculation="fixed"` always drafts the configured block; without a drafter every
round is one token. Must not touch scheduling or lifecycles: the engine asks `plan` before each
draft and reports each verify and draft.
"""

from __future__ import annotations

import attrs

from pdflash.spec.acceptance import AcceptanceModel, SequenceAcceptance
from pdflash.spec.policy import SPECULATION, PolicyInputs, RoundCosts, choose_block
from pdflash.spec.session import RoundTrace

EMA_WEIGHT = 0.1  # weight of the newest observation in the running estimates
FIT_DECAY = 0.95  # per verify: how fast the compute fit forgets
TOKEN_COST_PRIOR = 0.05  # seconds per token / fixed seconds, assumed until token counts vary


@attrs.define
class _ComputeFit:
    """verify compute seconds ≈ fixed + per_token × tokens, by decayed least squares."""

    w: float = 0.0
    x: float = 0.0  # Σ w·tokens
    y: float = 0.0  # Σ w·seconds
    xx: float = 0.0
    xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.w, self.x, self.y = FIT_DECAY * self.w + 1, FIT_DECAY * self.x + tokens, FIT_DECAY * self.y + seconds
        self.xx = FIT_DECAY * self.xx + tokens * tokens
        self.xy = FIT_DECAY * self.xy + tokens * seconds

    def solve(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s), or None before any verify."""
        if self.w == 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:  # all verifies about one size: split by the prior ratio
            fixed = my / (1 + TOKEN_COST_PRIOR * mx)
            return fixed, TOKEN_COST_PRIOR * fixed
        slope = max(0.0, (self.xy / self.w - mx * my) / var)
        return max(0.0, my - slope * mx), slope


class SpeculationPlanner:
    def __init__(self, mode: str, max_block: int, link_bytes_per_s: float | None) -> None:
        if mode not in SPECULATION:
            raise ValueError(f"speculation={mode!r} is not one of {', '.join(map(repr, SPECULATION))}")
        self.mode, self.max_block, self.link_bytes_per_s = mode, max_block, link_bytes_per_s
        self.acceptance = AcceptanceModel(max_block)
        self._fit = _ComputeFit()
        self._draft_s: float | None = None  # drafter seconds per drafted sequence
        self._batch: float | None = None  # sequences per batched verify
        self._position_bytes: list[float | None] = [None] * max_block  # [B] EMA bytes each position adds
        self._further_bytes: float | None = None  # EMA: what one more token would add (unmeasured positions)
        self.decisions: dict[int, int] = {}  # block length chosen -> rounds

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive" and self.max_block > 1

    @property
    def verify_fixed_s(self) -> float:
        """A batched verify's fixed seconds, whatever its tokens, as fitted (0 before any verify)."""
        fit = self._fit.solve()
        return fit[0] if fit is not None else 0.0

    @property
    def draft_s(self) -> float:
        """Drafter seconds per drafted sequence, as measured (0 before any draft)."""
        return self._draft_s or 0.0

    def track(self) -> SequenceAcceptance:
        return self.acceptance.for_sequence()

    # -- deciding ----------------------------------------------------------------------------------

    def plan(self, acceptance: SequenceAcceptance) -> int:
        """The next round's block for a sequence: the policy's choice once a verify is measured.

        Before that there is no compute or byte figure to weigh a draft against. With a link
        the first rounds decode plainly, the one choice that cannot lose to autoregressive
        decoding (a first full block in a link-bound regime fetched the union of every seat's
        block); resident, they draft the whole block. Fixed speculation always drafts it.
        """
        if not self.adaptive:
            block = self.max_block
        elif (inputs := self.inputs(acceptance)) is not None:
            block = choose_block(inputs).block
        else:
            block = self.max_block if self.link_bytes_per_s is None else 1
        self.decisions[block] = self.decisions.get(block, 0) + 1
        return block

    def inputs(self, acceptance: SequenceAcceptance) -> PolicyInputs | None:
        """What the policy is asked, or None until a verify has been measured (a drafter not yet
        measured costs nothing: the first draft the policy finds worth it measures it)."""
        fit = self._fit.solve()
        if fit is None or self._position_bytes[0] is None:
            return None
        fixed_s, token_s = fit
        prefix, total = [], 0.0
        # an unmeasured position costs what the last measured later position did, or, before any
        # was, what one more token would have added (the batch's leave-one-out)
        further = self._further_bytes if self._further_bytes is not None else self._position_bytes[0]
        assert further is not None  # position 0 is measured (checked above)
        for k, measured in enumerate(self._position_bytes):
            if measured is not None and k > 0:
                further = measured
            total += measured if measured is not None else further
            prefix.append(int(total))
        return PolicyInputs(
            acceptance=acceptance.estimate(),
            prefix_fetch_bytes=tuple(prefix),
            costs=RoundCosts(
                round_s=fixed_s / max(1.0, self._batch or 1.0),
                token_s=token_s,
                draft_s=self.draft_s,
                link_bytes_per_s=self.link_bytes_per_s,
            ),
        )

    # -- measuring ---------------------------------------------------------------------------------

    def observe_verify(self, traces: list[RoundTrace], compute_s: float) -> None:
        """A batched verify of `traces` took `compute_s` seconds of compute (link waits excluded)."""
        self._fit.observe(sum(t.tokens for t in traces), compute_s)
        self._batch = _ema(self._batch, float(len(traces)))
        for trace in traces:
            self._further_bytes = _ema(self._further_bytes, float(trace.further_token_bytes))
            for k, nbytes in enumerate(trace.position_fetch_bytes[: self.max_block]):
                self._position_bytes[k] = _ema(self._position_bytes[k], float(nbytes))

    def observe_draft(self, sequences: int, seconds: float) -> None:
        """The drafter lane drafted `sequences` blocks in `seconds`."""
        if sequences:
            self._draft_s = _ema(self._draft_s, seconds / sequences)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
