"""The engine's side of "how far to speculate": live estimates in, one block length per round out.

Owns the estimates the pure policy (pdflash.spec.policy) is fed: each sequence's acceptance
(pdflash.spec.acceptance), the bytes a block's first position adds on the link and what each
further position adds relative to it (measured by every verify: RoundTrace.position_fetch_bytes),
and what a round costs in time (a verify's
fixed and per-token seconds, fitted online from batched verifies; the drafter's seconds per
sequence; the seconds the verify lane waits between rounds). `speculation="fixed"` always
drafts the configured block; without a drafter every round is one token. Must not touch
scheduling or lifecycles: the engine asks `plan` before each draft, reports each verify,
draft and launch gap, and has the verify fit solved (`refit`) while the next verify runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import attrs
import numpy as np

from pdflash.spec.acceptance import AcceptanceModel, ConfidenceCalibration, SequenceAcceptance
from pdflash.spec.policy import SPECULATION, PolicyInputs, RoundCosts, VerifyCut, choose_block, expected_committed
from pdflash.spec.session import RoundTrace

EMA_WEIGHT = 0.1  # weight of the newest observation in the running estimates
SIZE_WINDOW = 20  # verifies of one size behind its running mean (a plain mean until then)
SIZE_DECAY = 0.99  # per verify: how fast a size not seen again loses weight in the fit
SIZE_FORGOTTEN = 0.01  # a size's weight below which the fit drops it
TOKEN_COST_PRIOR = 0.05  # seconds per token / fixed seconds, assumed until token counts vary
CALIBRATION_DECAY = 0.98  # per drafted round: the acceptance calibration remembers the last ~50
CALIBRATION_PRIOR = 4.0  # pseudo-drafts, realized as expected, behind the calibration
STALE_VERIFIES = 10  # verifies without reaching a block position before its byte ratio starts to fade
# verifies between two solves of the verify fit while the sizes it knows stay the same: each solve
# costs 0.3-0.4 ms on the event loop (3% of a plain round at c = 1 behind the link, back when it ran
# between a verify and the next round; `refit`), and a size's running mean moves by at most 1/20 of
# a surprise per verify
RESOLVE_EVERY = 8
# the verify fit's candidate column sets (0 fixed, 1 experts, 2 sequences, 3 tokens), in tie order
COLUMN_SUBSETS = sorted(used for k in range(1, 5) for used in itertools.combinations(range(4), k))
RANK_TOLERANCE = 1e-10  # an eigenvalue of a unit-scaled Gram matrix at or below it: dependent columns
SUBSET_MASKS = np.array([[j in used for j in range(4)] for used in COLUMN_SUBSETS])  # [S, 4]
SUBSET_PAIRS = SUBSET_MASKS[:, :, None] & SUBSET_MASKS[:, None, :]  # [S, 4, 4]: Gram entries inside each set
# the realized-rate guard (`SpeculationPlanner.drafting_loses`)
REALIZED_DECAY = 0.99  # per sequence-round of its kind: each realized rate remembers the last ~100
REALIZED_ROUNDS = 32.0  # decayed sequence-rounds of each kind before its realized rate is trusted
REALIZED_STALE = 2048  # plain sequence-rounds since the last block round before that rate is dropped


@attrs.frozen
class RoutingShape:
    """How the target routes: what a verify's distinct experts grow like with its tokens."""

    layers: int  # MoE layers
    experts: int  # experts per MoE layer
    top_k: int  # experts each token routes per layer

    @classmethod
    def of(cls, experts: Iterable[tuple[int, int]], top_k: int) -> RoutingShape | None:
        """The shape of a byte map's (layer, expert) keys; None without any."""
        keys = list(experts)
        if not keys or top_k < 1:
            return None
        return cls(layers=len({layer for layer, _ in keys}), experts=1 + max(e for _, e in keys), top_k=top_k)

    def uniform_union(self, tokens: float) -> float:
        """Expected distinct (layer, expert) pairs that `tokens` tokens route, each choosing its
        top_k of a layer's experts uniformly: top_k · layers for one token, every expert at most."""
        return self.layers * self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)


@attrs.frozen
class VerifyCost:
    """A batched verify's compute seconds ≈ fixed_s + sequence_s · N + token_s · T + expert_s · U(T)
    for N sequences of T tokens in all, where U(T) is the distinct experts T tokens route: what a
    MoE forward pays per sequence (its own attention over its own KV cache), per token (dense
    layers, the routed matmuls' rows) and per expert it touches (each a weight read and a call of
    its own).

    U saturates (16 tokens of the bundled pair route 88% of the experts 128 tokens do, under
    uniform routing), so a line through verify seconds against tokens alone, fitted where the engine has been
    (mostly plain rounds of one token per sequence), priced a block of 8 for 16 sequences at
    117 ms where it took 34: the policy never drafted there again (docs/engine.md). U(T) is the
    uniform-routing union, pulled toward the one-token union by `skew` (routers favour some
    experts: measured unions grow slower), as fitted to the unions the verifies routed.

    A sequence's rounds pay sequence_s whatever their block, so it favours longer blocks as the
    fixed seconds do. On the bundled pair behind the link (c = 32, CPU) a verify of 31 sequences
    of one token took 12x one of one token while routing 5x the experts, and one of 31 blocks of 8
    2.4x the 31 plain tokens: the cost is the sequences', not the tokens'. Priced per token, a
    block of 8 for 31 sequences looked 3.6x dearer than it was and the policy never drafted."""

    fixed_s: float
    token_s: float
    expert_s: float = 0.0
    sequence_s: float = 0.0
    routing: RoutingShape | None = None
    skew: float = 1.0  # measured union growth / uniform routing's (beyond the first token's union)

    def experts(self, tokens: float) -> float:
        """U(tokens): the distinct experts a verify of `tokens` tokens is expected to route."""
        if self.routing is None or tokens <= 0:
            return 0.0
        first = self.routing.uniform_union(1.0)
        return first * min(1.0, tokens) + self.skew * max(0.0, self.routing.uniform_union(tokens) - first)

    def variable_s(self, tokens: float) -> float:
        """The seconds a verify of `tokens` tokens costs beyond its fixed seconds."""
        return self.token_s * tokens + self.expert_s * self.experts(tokens)

    def seconds(self, tokens: float, sequences: float) -> float:
        return self.fixed_s + self.sequence_s * sequences + self.variable_s(tokens)

    def share_s(self, block: int, batch: float) -> float:
        """A sequence's share of the variable seconds of a verify of `batch` sequences that each
        verify `block` tokens: its own seconds and what its block adds to the batch, priced as if
        the batch's other sequences chose as it does (every sequence is asked alike). Priced at the
        margin instead (the others as they are), the experts a batch shares and a batched draft's
        fixed cost make every lone block dear, and a batch that decodes plainly never starts
        drafting together."""
        return self.sequence_s + self.variable_s(block * batch) / batch


@attrs.define
class _ComputeFit:
    """Each call size's running means of seconds (and of distinct experts routed and sequences
    verified), fitted to seconds ≈ fixed + per-unit × size (`solve`; a drafter's calls) or to
    `VerifyCost` (`solve_routed`).

    Sizes keep their own means, so the hundreds of one-token verifies a mostly plain-decoding
    engine runs between two drafted blocks do not wash out what the blocks were measured to
    cost (one decayed least-squares over the verifies fitted its slope to the last one or two
    blocks it still remembered: 1.4-4 ms a token where 0.7 was true). The first call of each
    size is a warm-up (buffers grown, a compiled step loaded: 3.6x a steady one, measured)
    and is left out: kept, it priced that size out for good once the policy stopped choosing it."""

    means_s: dict[int, float] = attrs.Factory(dict)  # size -> running mean seconds
    experts: dict[int, float] = attrs.Factory(dict)  # size -> running mean distinct experts routed
    sequences: dict[int, float] = attrs.Factory(dict)  # size -> running mean sequences in the call
    weights: dict[int, float] = attrs.Factory(dict)  # size -> decayed count of calls
    warmed: set[int] = attrs.Factory(set)  # sizes called at least once

    def observe(self, size: int, seconds: float, experts: int = 0, sequences: int = 0) -> None:
        if size not in self.warmed:
            self.warmed.add(size)
            return
        for known in list(self.weights):
            self.weights[known] *= SIZE_DECAY
            if self.weights[known] < SIZE_FORGOTTEN:
                del self.weights[known], self.means_s[known], self.experts[known], self.sequences[known]
        n = self.weights.get(size, 0.0) + 1.0
        self.weights[size] = n
        step = 1.0 / min(n, SIZE_WINDOW)
        self.means_s[size] = self.means_s.get(size, seconds) + (seconds - self.means_s.get(size, seconds)) * step
        self.experts[size] = self.experts.get(size, experts) + (experts - self.experts.get(size, experts)) * step
        self.sequences[size] = (
            self.sequences.get(size, sequences) + (sequences - self.sequences.get(size, sequences)) * step
        )

    def solve(self) -> tuple[float, float] | None:
        """(fixed_s, per_unit_s), or None before any call."""
        if not self.weights:
            return None
        w = sum(self.weights.values())
        mx = sum(n * size for size, n in self.weights.items()) / w
        my = sum(n * self.means_s[size] for size, n in self.weights.items()) / w
        if len(self.weights) < 2:  # one size: split by the prior ratio
            fixed = my / (1 + TOKEN_COST_PRIOR * mx)
            return fixed, TOKEN_COST_PRIOR * fixed
        var = sum(n * (size - mx) ** 2 for size, n in self.weights.items()) / w
        cov = sum(n * (size - mx) * (self.means_s[size] - my) for size, n in self.weights.items()) / w
        slope = max(0.0, cov / var)
        return max(0.0, my - slope * mx), slope

    def solve_routed(self, routing: RoutingShape | None) -> VerifyCost | None:
        """The verify cost (sizes are tokens), or None before any verify. With the routing shape,
        fixed, per-expert, per-sequence and per-token seconds by least squares over the sizes'
        means, each coefficient >= 0: the best fit of any subset of the four whose columns the
        sizes tell apart, the earlier columns in that order first on a tie (two sizes fit a line
        either way). So plain rounds alone, whose sequences are their tokens, put their cost on
        the sequences: blocks look cheap until verified, and the first verified ones say what a
        token costs. Without the shape, or with one size, `solve`'s line."""
        line = self.solve()
        if line is None:
            return None
        if routing is None or len(self.weights) < 2:
            return VerifyCost(fixed_s=line[0], token_s=line[1], routing=routing)
        sizes = sorted(self.weights)
        w = np.sqrt(np.array([self.weights[t] for t in sizes]))  # [n] row weights
        u = np.array([self.experts[t] for t in sizes])  # [n] experts routed
        first = routing.uniform_union(1.0)
        grown = np.array([routing.uniform_union(t) - first for t in sizes])  # [n] uniform growth beyond one token
        skew = float(np.clip(np.sum(grown * (u - first)) / max(np.sum(grown * grown), 1e-12), 0.05, 1.0))
        # [n, 4]: fixed, experts, sequences, tokens (the order ties are settled in)
        columns = np.stack(
            [np.ones(len(sizes)), u, np.array([self.sequences[t] for t in sizes]), np.array(sizes, dtype=float)], axis=1
        )
        columns *= w[:, None]
        independent, residuals, coefs = _subset_fits(columns, np.array([self.means_s[t] for t in sizes]) * w)
        # [S]: neither columns the sizes cannot tell apart nor a negative cost
        usable = independent & np.all(coefs >= 0, axis=1)
        best: tuple[float, int] | None = None
        for i, (ok, residual) in enumerate(zip(usable.tolist(), residuals.tolist())):
            if ok and (best is None or residual < best[0] * (1 - 1e-9) - 1e-18):
                best = (residual, i)
        assert best is not None  # the intercept alone is the weighted mean of positive seconds
        fixed, expert, sequence, token = coefs[best[1]].tolist()
        return VerifyCost(
            fixed_s=fixed, token_s=token, expert_s=expert, sequence_s=sequence, routing=routing, skew=skew
        )


def _subset_fits(columns: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """min ‖X·c − y‖² over each column set of `COLUMN_SUBSETS` at once, X = `columns` [n, 4]:
    ([S] whether the set's columns are linearly independent over the rows, [S] the squared
    residual, [S, 4] c, 0 outside the set).

    All sets in one batched solve of normal equations on unit-scaled columns (a set's matrix
    padded with the identity): the planner fits after every verify, and an lstsq per set (15
    calls, 50 µs each on matrices this small) cost 1.2 ms a verify on the event loop's thread,
    4% of a plain round at c = 1 behind the link."""
    norms = np.sqrt(np.einsum("ni,ni->i", columns, columns))  # [4]
    scaled = columns / np.where(norms > 0, norms, 1.0)  # [n, 4]
    normal = np.where(
        SUBSET_PAIRS, scaled.T @ scaled, np.eye(4)
    )  # [S, 4, 4]: the set's Gram matrix, identity outside it
    independent = (
        (SUBSET_MASKS.sum(axis=1) <= len(y))
        & np.all(~SUBSET_MASKS | (norms > 0), axis=1)
        & (np.linalg.eigvalsh(normal)[:, 0] > RANK_TOLERANCE)
    )  # [S]
    normal[~independent] = np.eye(4)
    rhs = np.where(SUBSET_MASKS, scaled.T @ y, 0.0)  # [S, 4]
    coef = np.linalg.solve(normal, rhs[:, :, None])[:, :, 0] / np.where(norms > 0, norms, 1.0)  # [S, 4]
    residual = np.sum((columns @ coef.T - y[:, None]) ** 2, axis=0)  # [S]
    return independent, residual, coef


class SpeculationPlanner:
    def __init__(
        self, mode: str, max_block: int, link_bytes_per_s: float | None, routing: RoutingShape | None = None
    ) -> None:
        if mode not in SPECULATION:
            raise ValueError(f"speculation={mode!r} is not one of {', '.join(map(repr, SPECULATION))}")
        self.mode, self.max_block, self.link_bytes_per_s = mode, max_block, link_bytes_per_s
        self.routing = routing  # None: verify seconds are fitted as a line in tokens alone
        self.acceptance = AcceptanceModel(max_block)
        # acceptance by the drafter's confidence: an argmax draft's and a drawn one's are different
        # bets (a drawn draft is accepted with chance Σ min(p, q), whatever q's peak)
        self.confidence = ConfidenceCalibration()  # greedy drafts
        self.sampled_confidence = ConfidenceCalibration()  # drafts drawn from q
        self._fit = _ComputeFit()  # verifies: sizes are tokens
        self._draft_fit = _ComputeFit()  # drafter calls: sizes are sequences drafted
        self._draft_s: float | None = None  # EMA: drafter seconds per drafted sequence, as the calls ran
        self._verify_cost: VerifyCost | None = None  # the verify fit, as last solved
        self._solved_sizes: frozenset[int] = frozenset()  # the verify sizes the last solve knew
        self._unsolved = 0  # verifies measured since the last solve
        self._draft_line: tuple[float, float] | None = None  # the drafter fit (fixed, per sequence), ditto
        self._batch: float | None = None  # sequences per batched verify
        self._idle_s: float | None = None  # EMA: seconds the verify lane waits between rounds, drafting aside
        self._base_bytes: float | None = None  # EMA: bytes a block's first position adds
        self._position_ratio = [_Ratio() for _ in range(max_block)]  # [B] bytes each position adds / the first's
        self._further_ratio = _Ratio()  # what one more token would add / the first position's (unmeasured ones)
        self._unreached = [0] * max_block  # [B] verifies since one last reached each position
        self.decisions: dict[int, int] = {}  # block length chosen -> rounds
        self._expected_drafts = CALIBRATION_PRIOR  # decayed Σ drafts the estimates expected accepted
        self._accepted_drafts = CALIBRATION_PRIOR  # decayed Σ drafts then accepted
        # what every sequence's round is priced at until the next observation (`_price`)
        self._prices: tuple[tuple[int, ...], RoundCosts] | None = None
        self._realized_blocks = _Realized()  # tokens and seconds of sequence-rounds that verified blocks
        self._realized_plain = _Realized()  # ... and of plain ones
        self._plain_since_block = 0  # plain sequence-rounds since the last block round
        self._blocks_seen = False  # a block round has been observed (plain ones before it are not compared)
        self.vetoed = 0  # rounds the policy would have drafted that the realized rates kept plain

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive" and self.max_block > 1

    @property
    def verify_fixed_s(self) -> float:
        """A batched verify's fixed seconds, whatever its tokens, as fitted (0 before any verify)."""
        cost = self._verify_cost
        return cost.fixed_s if cost is not None else 0.0

    def verify_s(self, tokens: int, sequences: int) -> float | None:
        """Compute seconds of a batched verify of `sequences` sequences, `tokens` tokens in all, as
        fitted (None before any verify)."""
        cost = self._verify_cost
        return cost.seconds(tokens, sequences) if cost is not None else None

    def draft_share_s(self, batch: float) -> float:
        """A sequence's share of a drafter call for `batch` sequences (a call's fixed seconds are
        shared, as `VerifyCost.share_s` prices a verify's): as fitted over the calls' sizes, or, before
        a size has been timed twice, the seconds per sequence the calls took (0 before any draft)."""
        return self.draft_call_s(batch) / batch

    def draft_call_s(self, sequences: float) -> float:
        """Seconds of one drafter call for `sequences` sequences: as fitted over the calls' sizes
        (a call's fixed seconds once, not once per sequence), or, before a size has been timed
        twice, the seconds per sequence the calls took times `sequences` (0 before any draft)."""
        fit = self._draft_line
        if fit is None:
            return self.draft_s * sequences
        return fit[0] + fit[1] * sequences

    @property
    def acceptance_calibration(self) -> float:
        """κ: drafts accepted / drafts the mean estimates expected, over recent drafted rounds.

        The policy drafts a sequence when its estimate is high, and an estimate is high partly
        by noise, so the rounds it drafts accept less than they were expected to (the winner's
        curse: link-bound at c = 4 on the bundled pair, 37 drafts accepted where 47 were
        expected, κ = 0.79). The policy weighs drafts at what they realized."""
        return self._accepted_drafts / self._expected_drafts

    @property
    def drafting_loses(self) -> bool:
        """Whether sequences' rounds that verified blocks have recently committed fewer tokens per
        second than their plain rounds, both measured (`observe_round`).

        The policy prices a round from fitted costs, and where drafting and plain decoding come
        close (resident on a CPU) a bias in them decides: at c = 32 on the bundled pair it drafted
        blocks of 8 at 2.3 tokens a round and made 791 tok/s where plain decoding made 934. What
        rounds realize is what the fit only predicts, so when it says blocks lose, the planner
        decodes plainly (as Cascade switches speculation off where it measured a slowdown). The
        blocks' rate is dropped after REALIZED_STALE plain rounds without one, so the policy
        drafts again and measures anew: a backed-off engine recovers where drafting pays again."""
        blocks, plain = self._realized_blocks.rate, self._realized_plain.rate
        return blocks is not None and plain is not None and blocks < plain

    @property
    def idle_s(self) -> float:
        """Seconds the verify lane waits between a sequence's rounds beyond drafting, as measured
        (`observe_idle`; 0 before any)."""
        return self._idle_s or 0.0

    @property
    def draft_s(self) -> float:
        """Drafter seconds per drafted sequence, as measured (0 before any draft)."""
        return self._draft_s or 0.0

    def track(self) -> SequenceAcceptance:
        return self.acceptance.for_sequence()

    # -- deciding ----------------------------------------------------------------------------------

    def plan(self, acceptance: SequenceAcceptance, *, greedy: bool = False) -> int:
        """The next round's block for a sequence: the policy's choice once a verify is measured.

        Whether to draft at all is decided on a posterior draw of the acceptance (Thompson
        sampling: while few rounds have drafted, draws now and then find a draft worth its cost,
        and the drafts that follow teach the estimates); the sequences planning between two
        verifies share one draw, so alike ones draft or decode plainly together. How far a greedy
        sequence then verifies is decided on the mean: its drafter drafts the whole block whatever
        the verify holds and every position is read against the tokens committed after it
        (`drafted_tokens`), so a short verify learns every position's acceptance as a long one
        does, and a long verify's bytes are paid for an acceptance the mean does not believe in
        (link-bound at c = 1 the draws' blocks of 7 and 8 were most of adaptive speculation's
        loss to plain decoding).
        What a position adds on the link is measured only where verifies reach it; unreached,
        its price fades toward what one more token adds (`observe_verify`). A sampled sequence
        learns only the positions it verifies: the draw decides its block too.

        Before a verify is measured there is no compute or byte figure to weigh a draft against.
        With a link the first rounds decode plainly, the one choice that cannot lose to
        autoregressive decoding (a first full block in a link-bound regime fetched the union of
        every seat's block); resident, they draft the whole block. Fixed speculation always
        drafts it.
        """
        if not self.adaptive:
            block = self.max_block
        elif (mean := self.inputs(acceptance)) is not None:
            block = choose_block(attrs.evolve(mean, acceptance=acceptance.draw())).block
            if block >= 2 and self.drafting_loses:
                block, self.vetoed = 1, self.vetoed + 1
            elif block >= 2 and greedy:
                block = choose_block(mean, shortest=2).block
        else:
            block = self.max_block if self.link_bytes_per_s is None else 1
        self.decisions[block] = self.decisions.get(block, 0) + 1
        return block

    def cut(self, acceptance: SequenceAcceptance, block: int, *, greedy: bool) -> VerifyCut | None:
        """How a sequence's planned block of drafts is cut once they are made (the policy asked
        again, each draft's acceptance read off the drafter's confidence in it, by the table of
        its kind of draft); None where the round does not draft or speculation is fixed. Whether a
        sampled request's drafts may be cut at all is its own (pdflash.engine.round_work)."""
        if not (self.adaptive and block >= 2) or (inputs := self.inputs(acceptance)) is None:
            return None
        return VerifyCut(inputs=inputs, table=self._calibration(greedy).table())

    def expected_tokens(
        self, acceptance: SequenceAcceptance, tokens: int, confidence: tuple[float, ...], *, greedy: bool = True
    ) -> float:
        """E[committed] of a pending verify of `tokens` tokens, uncalibrated: read off its drafts'
        `confidence` where the drafter gave one (DraftResult.confidence), else off the sequence's
        mean estimate."""
        if confidence:
            return expected_committed(self._calibration(greedy).table().of(confidence), tokens)
        return expected_committed(acceptance.estimate(), tokens)

    def observe_drafts(
        self, confidence: tuple[float, ...], tokens: int, accepted_drafts: int, *, greedy: bool = True
    ) -> None:
        """A verify of `tokens` tokens accepted `accepted_drafts` of its drafts, drafted with these
        confidences (the block's, then a greedy block's shadow's): what the confidence told."""
        if confidence:
            self._calibration(greedy).observe(confidence[: tokens - 1], accepted_drafts)

    def _calibration(self, greedy: bool) -> ConfidenceCalibration:
        return self.confidence if greedy else self.sampled_confidence

    def drafted_tokens(self, block: int, *, greedy: bool) -> int:
        """Tokens the drafter makes for a round that verifies `block` (anchor included; 1: the
        drafter does not run). A greedy sequence under adaptive speculation drafts the whole block
        whenever the drafter runs (one forward drafts it all) and leaves what it does not verify
        to be read against the tokens it commits next (pdflash.spec.shadow): each draft teaches
        the acceptance estimates of every position, not only of those the policy chose to verify.
        A sampled sequence drafts its planned block, and a cut only shortens it: a drawn draft
        past the verify teaches nothing (only an argmax draft can be read against the tokens
        committed after it), so drafting past the plan would buy only the chance of a longer cut."""
        if self.adaptive and greedy and block >= 2:
            return self.max_block
        return block

    def inputs(self, acceptance: SequenceAcceptance) -> PolicyInputs | None:
        """What the policy is asked, at the acceptance estimate's mean (`plan` also asks it at a
        draw), or None until a verify has been measured (a drafter not yet measured costs
        nothing: the first draft the policy finds worth it measures it)."""
        prices = self._prices or self._price()
        if prices is None:
            return None
        prefix, costs = prices
        return PolicyInputs(
            acceptance=acceptance.estimate(),
            prefix_fetch_bytes=prefix,
            costs=costs,
            acceptance_calibration=self.acceptance_calibration,
        )

    def _price(self) -> tuple[tuple[int, ...], RoundCosts] | None:
        """A round's prices, the same for every sequence: ([B] prefix fetch bytes, costs), kept
        until a verify, drafter call or launch gap is next measured (the sequences of a batch plan
        between two: at c = 16 built once instead of 16 times, 10-20 µs each on the event loop),
        or None before a verify is measured."""
        cost = self._verify_cost
        if cost is None or self._base_bytes is None:
            return None
        batch = max(1.0, self._batch or 1.0)
        # a later position costs the first position's bytes now times what it added relative to
        # the first in the rounds that reached it (fading toward what one more token would add
        # while no round does); an unmeasured one what the last measured later position did, or,
        # before any was, what one more token would have added (leave-one-out)
        prefix, total, ratio = [], self._base_bytes, self._further_ratio.value
        prefix.append(int(total))
        for measured in self._position_ratio[1:]:
            ratio = measured.value if measured.value is not None else ratio
            total += (ratio if ratio is not None else 1.0) * self._base_bytes
            prefix.append(int(total))
        costs = RoundCosts(
            round_s=(cost.fixed_s + (self._idle_s or 0.0)) / batch,
            block_s=tuple(cost.share_s(b, batch) for b in range(1, self.max_block + 1)),
            draft_s=self.draft_share_s(batch),
            link_bytes_per_s=self.link_bytes_per_s,
        )
        self._prices = (tuple(prefix), costs)
        return self._prices

    # -- measuring ---------------------------------------------------------------------------------

    def observe_verify(self, traces: list[RoundTrace], compute_s: float | None, experts: int = 0) -> None:
        """A batched verify of `traces` took `compute_s` seconds of compute (link waits excluded;
        None: its forward also prefilled prompts, so its seconds are not a verify's) and routed
        `experts` distinct (layer, expert) pairs."""
        self.acceptance.next_draw()
        self._prices = None
        if compute_s is not None:
            self._fit.observe(sum(t.tokens for t in traces), compute_s, experts, len(traces))
            self._unsolved += 1
        self._batch = _ema(self._batch, float(len(traces)))
        measured = [t for t in traces if t.position_fetch_bytes]
        for trace in measured:
            first = trace.position_fetch_bytes[0]
            self._base_bytes = _ema(self._base_bytes, float(first))
            self._further_ratio.observe(trace.further_token_bytes, first)
            for k, nbytes in enumerate(trace.position_fetch_bytes[1 : self.max_block], start=1):
                self._position_ratio[k].observe(nbytes, first)
        # a position no verify has reached for a while fades toward what one more token would
        # add: a ratio measured once, at another concurrency or by the few sequences that
        # drafted, held at every later one (one round of 2 at c = 1 priced each later position at
        # 1.67 first positions at c = 32, where one more token added 0.3) and kept the policy
        # from drafting again to measure it
        if not measured:
            return
        reached = max(len(t.position_fetch_bytes) for t in measured)
        further_mean = sum(t.further_token_bytes for t in measured) / len(measured)
        first_mean = sum(t.position_fetch_bytes[0] for t in measured) / len(measured)
        for k, ratio in enumerate(self._position_ratio):
            self._unreached[k] = 0 if k < reached else self._unreached[k] + 1
            if self._unreached[k] > STALE_VERIFIES and ratio.value is not None:
                ratio.observe(further_mean, first_mean)

    def refit(self) -> None:
        """Solve the verify fit again if the verifies measured since the last solve call for it:
        a size it did not know (priced at once), or RESOLVE_EVERY verifies of known sizes. The
        engine calls it once the next verify is on its lane, so the solve (0.3-0.5 ms on the
        event loop's thread, its caches cold after a forward) overlaps that forward instead of
        sitting between a verify and the next round's launch: at c = 1 every round waits for what
        runs there. Prices lag by one launch."""
        if (sizes := frozenset(self._fit.weights)) != self._solved_sizes or self._unsolved >= RESOLVE_EVERY:
            self._verify_cost = self._fit.solve_routed(self.routing)
            self._prices = None
            self._solved_sizes, self._unsolved = sizes, 0

    def observe_committed(self, expected_tokens: float, committed: int) -> None:
        """A verified block of drafts committed `committed` tokens where the sequence's mean
        estimate, when it was planned, expected `expected_tokens` (uncalibrated); the bonus
        token is not a draft."""
        self._expected_drafts = CALIBRATION_DECAY * self._expected_drafts + (expected_tokens - 1.0)
        self._accepted_drafts = CALIBRATION_DECAY * self._accepted_drafts + (committed - 1.0)

    def observe_round(self, block: int, committed: int, seconds: float) -> None:
        """A sequence's verify of `block` tokens committed `committed` tokens, `seconds` after its
        previous verify ended: its whole round (drafting, waiting for admission and for the batch,
        verifying), whatever the others in its batches did. What `drafting_loses` compares."""
        if block >= 2:
            self._realized_blocks.observe(committed, seconds)
            self._plain_since_block, self._blocks_seen = 0, True
            return
        if not self._blocks_seen:
            # before any block round, plain rounds ran in batches still forming (prefill waves, a
            # link-bound engine's unpriced first rounds): at c = 32 their rate was 1.4x that of the
            # plain rounds among full batches, and vetoed ~60 block rounds after every cold start
            return
        self._realized_plain.observe(committed, seconds)
        self._plain_since_block += 1
        if self._plain_since_block == REALIZED_STALE:
            self._realized_blocks = _Realized()

    def observe_idle(self, seconds: float) -> None:
        """The verify lane waited `seconds` between a verify and the next launch of one of its
        sequences, beyond what drafting took: the engine's hand-offs between a round's stages
        (streaming, planning, the tick, waking the lanes) and a plain round's projection. At low
        concurrency every round pays them once, whatever its block, as it pays a verify's fixed
        seconds; at high concurrency the next batch is admitted while one runs and they vanish.
        Priced with the fixed seconds, they make plain decoding as dear as it is."""
        self._idle_s = _ema(self._idle_s, max(0.0, seconds))
        self._prices = None

    def observe_draft(self, sequences: int, seconds: float) -> None:
        """The drafter lane drafted `sequences` blocks in `seconds`."""
        if sequences:
            self._draft_s = _ema(self._draft_s, seconds / sequences)
            self._draft_fit.observe(sequences, seconds)
            self._draft_line = self._draft_fit.solve()
            self._prices = None


@attrs.define
class _Ratio:
    """Σ numerator / Σ denominator over the observations, each sum an EMA (a ratio of sums: a
    round whose first position fetched almost nothing does not blow it up)."""

    numerator: float | None = None
    denominator: float | None = None

    def observe(self, numerator: float, denominator: float) -> None:
        self.numerator = _ema(self.numerator, float(numerator))
        self.denominator = _ema(self.denominator, float(denominator))

    @property
    def value(self) -> float | None:
        """The ratio, or None before any observation with a denominator."""
        return self.numerator / self.denominator if self.numerator is not None and self.denominator else None


@attrs.define
class _Realized:
    """Decayed sums over sequence-rounds of one kind: tokens committed and seconds taken."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = REALIZED_DECAY * self.tokens + tokens
        self.seconds = REALIZED_DECAY * self.seconds + seconds
        self.rounds = REALIZED_DECAY * self.rounds + 1.0

    @property
    def rate(self) -> float | None:
        """Tokens per second of a sequence's round, or None before REALIZED_ROUNDS are measured."""
        return self.tokens / self.seconds if self.rounds >= REALIZED_ROUNDS and self.seconds > 0 else None


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
