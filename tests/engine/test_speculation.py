"""The engine's speculation planner: its live estimates, and the policy's choices inside the engine."""

from __future__ import annotations

from collections import Counter
from itertools import count
from types import SimpleNamespace

import numpy as np
import pytest
from engine_cases import collect, drained
from test_engine import GREEDY, PROMPTS, SlowLink

from pdflash.engine.round_work import RoundWork
from pdflash.engine.speculation import (
    COLUMN_SUBSETS,
    REALIZED_DECAY,
    REALIZED_ROUNDS,
    REALIZED_STALE,
    RESOLVE_EVERY,
    RoutingShape,
    SpeculationPlanner,
    VerifyCost,
    _ComputeFit,
    _subset_fits,
)
from pdflash.sampling import SamplingParams
from pdflash.spec.acceptance import SequenceAcceptance
from pdflash.spec.policy import choose_block, expected_committed
from pdflash.spec.projection import ProjectionQuality
from pdflash.spec.session import RoundTrace
from pdflash.spec.speculator import Speculator


def trace(tokens: int, position_bytes: tuple[int, ...], further: int = 0) -> RoundTrace:
    return RoundTrace(
        start=0,
        tokens=tokens,
        acceptance_length=1,
        expert_bytes=0,
        fetch_bytes=0,
        actual_bytes=sum(position_bytes),
        quality=ProjectionQuality(coverage=1.0, coverage_bytes=1.0, waste_bytes=0),
        position_fetch_bytes=position_bytes,
        further_token_bytes=further,
    )


def verified(planner: SpeculationPlanner, traces: list[RoundTrace], *measured) -> None:
    """A verify measured, then the next one launched: the engine's order (VerifyPacer._launch refits)."""
    planner.observe_verify(traces, *measured)
    planner.refit()


def planned(planner: SpeculationPlanner, seq, rounds: int, **kwargs) -> Counter[int]:
    """The blocks one sequence plans over `rounds` rounds, a new draw each (as a verify brings)."""
    chosen: Counter[int] = Counter()
    for _ in range(rounds):
        planner.acceptance.next_draw()
        chosen[planner.plan(seq, **kwargs)] += 1
    return chosen


def test_the_compute_fit_recovers_fixed_and_per_token_seconds():
    fit = _ComputeFit()
    assert fit.solve() is None
    for tokens in (1, 8, 3, 16, 2, 8, 32, 1) * 2:
        fit.observe(tokens, 0.010 + 0.002 * tokens)
    fixed, per_token = fit.solve()
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(0.002)


def test_each_size_keeps_its_cost_through_many_verifies_of_another():
    """A mostly plain-decoding engine runs hundreds of one-token verifies between two blocks: what
    a block costs must not fade with them, and a size's first (warm-up) verify does not count."""
    fit = _ComputeFit()
    fit.observe(8, 0.100)  # warm-up: buffers grown, a step loaded
    fit.observe(1, 0.100)
    fit.observe(8, 0.024)
    for _ in range(300):
        fit.observe(1, 0.012)
    fixed, per_token = fit.solve()
    assert per_token == pytest.approx(0.012 / 7) and fixed == pytest.approx(0.012 - 0.012 / 7)
    for _ in range(1000):  # a size not seen for long enough is forgotten
        fit.observe(1, 0.012)
    assert fit.solve() == pytest.approx((0.012 / 1.05, 0.05 * 0.012 / 1.05))


def test_one_verify_size_splits_by_the_prior_ratio():
    fit = _ComputeFit()
    for _ in range(6):
        fit.observe(8, 0.014)
    fixed, per_token = fit.solve()
    assert fixed + 8 * per_token == pytest.approx(0.014)
    assert per_token == pytest.approx(0.05 * fixed)


BUNDLED = RoutingShape(layers=4, experts=32, top_k=4)  # the bundled target's routing


def test_a_routing_shape_counts_the_experts_its_tokens_route():
    assert RoutingShape.of([(layer, e) for layer in range(4) for e in range(32)], top_k=4) == BUNDLED
    assert RoutingShape.of([], top_k=4) is None
    assert BUNDLED.uniform_union(1) == pytest.approx(16)  # top_k in each layer
    assert BUNDLED.uniform_union(16) == pytest.approx(128 * (1 - (28 / 32) ** 16))
    assert BUNDLED.uniform_union(10_000) == pytest.approx(128)  # every expert, at most
    skewed = VerifyCost(fixed_s=0.0, token_s=0.0, expert_s=1.0, routing=BUNDLED, skew=0.5)
    assert skewed.experts(1) == pytest.approx(16)  # one token's union is top_k per layer whatever the skew
    assert skewed.experts(16) == pytest.approx(16 + 0.5 * (BUNDLED.uniform_union(16) - 16))


def routed_seconds(tokens: int, skew: float = 1.0) -> tuple[float, int]:
    """(seconds, experts) of a verify whose cost is 3 ms + 0.2 ms a token + 0.1 ms an expert routed."""
    experts = VerifyCost(fixed_s=0.0, token_s=0.0, expert_s=1.0, routing=BUNDLED, skew=skew).experts(tokens)
    return 0.003 + 0.0002 * tokens + 0.0001 * experts, round(experts)


@pytest.mark.parametrize("skew", [1.0, 0.6])
def test_the_routed_fit_recovers_fixed_token_and_expert_seconds(skew):
    fit = _ComputeFit()
    assert fit.solve_routed(BUNDLED) is None
    for tokens in (1, 4, 16, 9, 2, 12) * 2:  # plain rounds and short blocks only
        fit.observe(tokens, *routed_seconds(tokens, skew))
    cost = fit.solve_routed(BUNDLED)
    assert cost.skew == pytest.approx(skew, abs=0.01)
    assert (cost.fixed_s, cost.token_s, cost.expert_s) == pytest.approx((0.003, 0.0002, 0.0001), rel=0.05, abs=2e-5)
    # what it never saw: a block of 8 for 16 sequences costs what the model says, not what a line
    # in tokens through 1 .. 16 extrapolates
    assert cost.seconds(128, 16) == pytest.approx(routed_seconds(128, skew)[0], rel=0.03)
    line = fit.solve()
    assert line[0] + 128 * line[1] > 1.5 * routed_seconds(128, skew)[0]


def test_two_verify_sizes_fit_the_experts_not_a_line_in_tokens():
    """Two sizes fit any two-parameter model exactly; the one by experts routed is kept: it prices
    a larger verify by what more tokens can still add, so the policy tries one and measures it."""
    fit = _ComputeFit()
    for tokens in (1, 16) * 2:
        fit.observe(tokens, *routed_seconds(tokens))
    cost = fit.solve_routed(BUNDLED)
    assert cost.token_s == 0 and cost.expert_s > 0
    assert cost.seconds(1, 1) == pytest.approx(routed_seconds(1)[0], rel=1e-3)
    assert cost.seconds(16, 16) == pytest.approx(routed_seconds(16)[0], rel=1e-3)
    assert fit.solve_routed(None) == VerifyCost(fixed_s=fit.solve()[0], token_s=fit.solve()[1])  # no shape: the line


def sequence_seconds(sequences: int, block: int) -> tuple[float, int]:
    """(seconds, experts) of a verify of `sequences` blocks of `block` tokens whose cost is 4 ms +
    2.4 ms a sequence + 0.5 ms a token beyond a sequence's first (the bundled pair behind the link:
    31 plain tokens 12x one, 31 blocks of 8 2.4x 31 plain tokens), routing as the bundled target."""
    tokens = sequences * block
    experts = VerifyCost(fixed_s=0.0, token_s=0.0, expert_s=1.0, routing=BUNDLED).experts(tokens)
    return 0.004 + 0.0024 * sequences + 0.0005 * (tokens - sequences), round(experts)


def test_plain_rounds_put_their_cost_on_the_sequences_until_blocks_say_what_a_token_costs():
    fit = _ComputeFit()
    for sequences in (1, 31, 16, 31, 1, 8) * 3:  # plain rounds: as many tokens as sequences
        fit.observe(sequences, *sequence_seconds(sequences, 1), sequences)
    plain = fit.solve_routed(BUNDLED)
    assert plain.token_s == 0 and plain.sequence_s == pytest.approx(0.0024, rel=0.05)
    # a block of 8 for 31 sequences is priced by what its extra tokens route, not at 8x the tokens'
    # seconds a line through plain rounds gives (what kept the policy from ever drafting)
    line = fit.solve()
    assert plain.seconds(248, 31) < 0.6 * (line[0] + 248 * line[1])
    for sequences in (31, 16) * 3:  # the policy tried blocks of 8: now a token's seconds are known
        fit.observe(8 * sequences, *sequence_seconds(sequences, 8), sequences)
    measured = fit.solve_routed(BUNDLED)
    assert measured.seconds(248, 31) == pytest.approx(sequence_seconds(31, 8)[0], rel=0.05)
    assert measured.seconds(31, 31) == pytest.approx(sequence_seconds(31, 1)[0], rel=0.05)


@pytest.mark.parametrize("seed", range(20))
def test_the_batched_subset_fits_equal_one_least_squares_per_column_set(seed):
    """Oracle: numpy's lstsq on each column set alone, on rows with dependent columns (plain
    rounds: sequences = tokens; a saturated union: experts constant) and without."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    sequences = rng.integers(1, 32, n).astype(float)
    tokens = sequences if seed % 3 == 0 else sequences * rng.integers(1, 9, n)
    experts = np.full(n, 128.0) if seed % 4 == 1 else rng.uniform(16, 128, n)
    columns = np.stack([np.ones(n), experts, sequences, tokens], axis=1) * rng.uniform(0.5, 3, n)[:, None]
    y = columns @ rng.uniform(0, 1e-3, 4) + rng.normal(0, 1e-4, n) * (seed % 2)
    independent, residuals, coefs = _subset_fits(columns, y)
    for used, ok, residual, coef in zip(COLUMN_SUBSETS, independent, residuals, coefs):
        want, _, rank, _ = np.linalg.lstsq(columns[:, used], y, rcond=None)
        assert ok == (rank == len(used)), used
        if ok:
            assert coef[list(used)] == pytest.approx(want, rel=1e-6, abs=1e-12)
            assert np.all(coef[[j for j in range(4) if j not in used]] == 0)
            assert residual == pytest.approx(float(np.sum((columns[:, used] @ want - y) ** 2)), rel=1e-6, abs=1e-18)


def test_one_sequence_at_a_time_leaves_the_sequences_column_to_the_fixed_seconds():
    fit = _ComputeFit()
    for block in (1, 4, 8, 2) * 3:  # c = 1: the sequences column is the intercept's
        fit.observe(block, *sequence_seconds(1, block), 1)
    cost = fit.solve_routed(BUNDLED)
    assert cost.sequence_s == 0
    assert cost.seconds(8, 1) == pytest.approx(sequence_seconds(1, 8)[0], rel=0.05)


def test_a_sequence_is_priced_its_share_of_a_batch_that_chooses_as_it_does():
    cost = VerifyCost(fixed_s=0.003, token_s=0.0002, expert_s=0.0001, routing=BUNDLED)
    assert cost.share_s(8, 1) == pytest.approx(cost.variable_s(8))  # alone: the whole verify
    assert cost.share_s(8, 16) == pytest.approx(cost.variable_s(128) / 16)
    assert cost.share_s(8, 16) < 8 * cost.share_s(1, 16)  # the batch's experts are shared
    linear = VerifyCost(fixed_s=0.003, token_s=0.0002)
    assert linear.share_s(8, 16) == pytest.approx(8 * 0.0002)  # without a shape: per token, as before
    own = VerifyCost(fixed_s=0.003, token_s=0.0002, sequence_s=0.002)
    assert own.share_s(8, 16) == pytest.approx(0.002 + 8 * 0.0002)  # its own seconds, whatever its block


def test_a_batch_that_decodes_plainly_still_finds_blocks_worth_drafting_together():
    """The regression this model fixes (resident, 16 sequences, the bundled pair, CPU): having
    verified mostly plain rounds, a line in tokens priced a block of 8 for all 16 at 3.5x what it
    took, and a lone draft at the fixed cost of a whole drafter call, so the policy decoded
    plainly (634 tok/s) where blocks of 8 made 716 (tests/engine/test_speculation.py's costs are
    that run's, rounded)."""
    for routing, drafts in ((BUNDLED, True), (None, False)):
        planner = SpeculationPlanner("adaptive", 8, link_bytes_per_s=None, routing=routing)
        for tokens in (1, 16, 15, 16, 1, 15) * 3:  # plain rounds, as the requests come and go
            seconds, experts = routed_seconds(tokens)
            verified(planner, [trace(1, (0,))] * tokens, seconds, experts)
        for _ in range(3):
            planner.observe_draft(1, 0.004)  # lone drafts: one call's fixed cost for one sequence
        for _ in range(16):
            verified(planner, [trace(1, (0,))] * 16, *routed_seconds(16))
        seq = planner.track()
        for accepted in (1, 3, 2, 0, 4, 2) * 5:  # τ ≈ 3 for a block of 8, as that run's
            seq.observe(8, accepted)
        assert (choose_block(planner.inputs(seq)).block > 1) == drafts, routing
    assert planner.draft_share_s(1) == pytest.approx(0.004)  # one size timed: its seconds, split by the prior
    planner.observe_draft(16, 0.008)
    planner.observe_draft(16, 0.008)
    assert planner.draft_share_s(16) == pytest.approx(0.008 / 16)  # the fitted call, shared


def test_drafts_in_one_call_are_expected_to_take_one_call_not_one_per_sequence():
    """What a gathering launch waits for (pacer._gather_s): sequences drafting together run as one
    drafter call. Counted as one call per sequence (the mean seconds per sequence times them), three
    drafts of 3 + 2 ms each looked due in 14 ms, past a resident verify's fixed 8 ms, so the launch
    went alone (c = 4, one thread a lane: 39 of ~165 rounds verified alone)."""
    planner = SpeculationPlanner("adaptive", 8, link_bytes_per_s=None, routing=BUNDLED)
    assert planner.draft_call_s(3) == 0.0  # nothing drafted yet
    planner.observe_draft(1, 0.005)
    assert planner.draft_call_s(3) == pytest.approx(0.015)  # one size timed (warm-up): per sequence
    for sequences in (1, 4, 1, 4, 1, 4):
        planner.observe_draft(sequences, 0.003 + 0.002 * sequences)
    assert planner.draft_call_s(3) == pytest.approx(0.009)
    assert planner.draft_share_s(3) == pytest.approx(0.003)


def test_until_it_has_measured_the_planner_decodes_plainly_with_a_link_and_drafts_the_block_without():
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    seq = planner.track()
    assert planner.plan(seq) == 1 and planner.inputs(seq) is None  # nothing measured, bytes matter
    assert SpeculationPlanner("adaptive", 4, link_bytes_per_s=None).plan(seq) == 4  # resident
    verified(planner, [trace(1, (1000,), further=300), trace(1, (1000,), further=300)], 0.02)
    assert planner.inputs(seq) is None  # a size's first verify is a warm-up: no compute figure yet
    verified(planner, [trace(1, (1000,), further=300), trace(1, (1000,), further=300)], 0.02)
    assert planner.inputs(seq).costs.draft_s == 0  # the drafter not yet measured costs nothing
    # no later position measured yet: each costs what one more token would have added (leave-one-out)
    assert planner.inputs(seq).prefix_fetch_bytes == (1000, 1300, 1600, 1900)
    planner.observe_draft(2, 0.004)
    for _ in range(2):
        verified(planner, [trace(4, (1000, 400), further=300), trace(4, (1000, 400), further=300)], 0.02)
    inputs = planner.inputs(seq)
    # unmeasured positions after a measured later one cost what it did
    assert inputs.prefix_fetch_bytes == (1000, 1400, 1800, 2200)
    assert inputs.costs.draft_s == pytest.approx(0.002) and inputs.costs.link_bytes_per_s == 1e6
    # measured: the policy decides (cheap positions, 0.6 acceptance: the whole block, not the unmeasured
    # 1), on posterior draws that scatter around that choice while so little has been observed
    assert choose_block(inputs).block == 4
    chosen = planned(planner, seq, 200)
    assert chosen.most_common(1)[0][0] == 4 and len(chosen) > 1, chosen
    assert sum(planner.decisions.values()) == 201


def test_a_greedy_sequence_drafts_when_a_draw_says_so_and_verifies_as_far_as_the_mean_says():
    """Whether to draft: a posterior draw (exploration). How far a greedy sequence verifies once it
    drafts: the mean estimate, because its drafter drafts the whole block anyway and every
    position is read as a shadow draft. A sampled sequence learns only what it verifies: its
    block stays the draw's."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e5)
    planner.observe_draft(2, 0.004)
    for _ in range(2):
        verified(planner, [trace(4, (1000, 600, 600, 600), further=600)] * 2, 0.02)
    seq = planner.track()
    mean = planner.inputs(seq)
    assert choose_block(mean).block == 2  # the mean's best block, drafting or not
    greedy = planned(planner, seq, 400, greedy=True)
    sampled = planned(planner, seq, 400)
    assert set(greedy) == {1, 2}, greedy  # draws still decide whether to draft, not how far
    assert {3, 4} <= set(sampled), sampled


def test_a_round_that_drafts_is_cut_by_its_drafts_confidence_once_they_are_made():
    """The planner hands a drafting round a cut (the policy again, at the mean, with the drafter's
    confidence for acceptance, from the table of its kind of draft); a plain, fixed or unpriced
    round none. A pending verify is expected to commit what its drafts' confidence says, and
    verifies teach the table of their kind."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e5)
    seq = planner.track()
    assert planner.cut(seq, 4, greedy=True) is None  # nothing measured: nothing to price a cut with
    planner.observe_draft(2, 0.004)
    for _ in range(2):
        verified(planner, [trace(4, (1000, 600, 600, 600), further=600)] * 2, 0.02)
    cut = planner.cut(seq, 2, greedy=True)
    assert cut is not None and cut.inputs == planner.inputs(seq) and cut.table == planner.confidence.table()
    assert planner.cut(seq, 1, greedy=True) is None
    drawn = planner.cut(seq, 4, greedy=False)
    assert drawn is not None and drawn.table == planner.sampled_confidence.table()
    assert SpeculationPlanner("fixed", 4, link_bytes_per_s=1e5).cut(seq, 4, greedy=True) is None

    sure = (0.97, 0.97, 0.97)  # a block of 3 with a shadow draft: the drafter's confidence in each draft
    assert planner.expected_tokens(seq, 3, sure) == pytest.approx(1 + 0.97 + 0.97**2)
    assert planner.expected_tokens(seq, 3, ()) == pytest.approx(expected_committed(seq.estimate(), 3))
    for _ in range(500):  # the drafter's sure drafts are rejected: the first of each block read
        planner.observe_drafts(sure, 3, accepted_drafts=0)
    assert planner.confidence.table().of((0.97,))[0] < 0.05
    assert planner.expected_tokens(seq, 3, sure) < 1.05
    # drawn drafts keep their own table: what argmax drafts taught does not move it
    assert planner.expected_tokens(seq, 3, sure, greedy=False) == pytest.approx(1 + 0.97 + 0.97**2)  # its prior
    for _ in range(500):
        planner.observe_drafts(sure, 3, accepted_drafts=2, greedy=False)
    assert planner.sampled_confidence.table().of((0.97,))[0] > 0.95
    assert planner.confidence.table().of((0.97,))[0] < 0.05


def test_the_verify_fit_is_solved_at_the_next_launch_when_its_sizes_change_and_every_few_verifies():
    """Solving costs 0.3-0.5 ms on the event loop: `observe_verify` only records, and `refit` (run
    by the pacer once the next verify is on its lane) solves when a size is new, and a known
    size's drifting mean every RESOLVE_EVERY verifies."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    one = [trace(1, (1000,))]
    verified(planner, one, 0.010)  # a warm-up: no size known, nothing to solve
    assert planner.verify_s(1, 1) is None
    planner.observe_verify(one, 0.010)  # the first size known
    assert planner.verify_s(1, 1) is None  # recorded, not yet solved: the verify's own hand-off stays short
    planner.refit()
    assert planner.verify_s(1, 1) == pytest.approx(0.010)
    for _ in range(RESOLVE_EVERY - 1):  # its mean drifts toward 30 ms; the fit waits
        verified(planner, one, 0.030)
        assert planner.verify_s(1, 1) == pytest.approx(0.010)
    verified(planner, one, 0.030)  # the RESOLVE_EVERY-th since the solve
    assert planner.verify_s(1, 1) > 0.020
    verified(planner, [trace(4, (1000, 400))], 0.040)  # warm-up of size 4: its mean not kept
    held = planner.verify_s(4, 1)
    verified(planner, [trace(4, (1000, 400))], 0.040)  # a new size: solved at the first launch after it
    assert planner.verify_s(4, 1) != held and planner.verify_s(4, 1) == pytest.approx(0.040, rel=0.05)


def test_later_positions_cost_what_they_added_relative_to_the_first_at_the_first_positions_bytes_now():
    """When the cache turns cold (a new prompt's first rounds) a block's first position fetches
    more, and so do the positions after it: each later position is priced at the first position's
    bytes now times what it added relative to the first in the rounds that reached it, not at
    bytes measured in another phase (which made blocks look cheap exactly when plain rounds were
    dear, and the drafted rounds then fetched 1.6x the bytes per extra token they were priced at)."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    for _ in range(2):  # warm: the first position 1000 bytes, the second 500, the third 250
        verified(planner, [trace(4, (1000, 500, 250, 250), further=500)] * 2, 0.02)
    assert planner.inputs(planner.track()).prefix_fetch_bytes == (1000, 1500, 1750, 2000)
    for _ in range(40):  # cold: plain rounds whose first (only) position fetches twice as much
        verified(planner, [trace(1, (2000,), further=1000)] * 2, 0.02)
        verified(planner, [trace(4, (2000, 1000, 500, 500), further=1000)] * 2, 0.02)  # and blocks
    prefix = planner.inputs(planner.track()).prefix_fetch_bytes
    assert prefix[0] == pytest.approx(2000, rel=0.01)
    assert prefix == pytest.approx((prefix[0], 1.5 * prefix[0], 1.75 * prefix[0], 2 * prefix[0]), rel=0.01)


def test_a_position_no_verify_reaches_fades_toward_what_one_more_token_adds():
    """The regression (behind the link, the bundled pair): the one round of 2 that a request alone
    drafted fetched 1.67x the first position's bytes for its second; at c = 32, where one more
    token added 0.3 first positions, that ratio priced every block of 8 at 12.7 first positions,
    and the policy never drafted again to measure it. While no verify reaches a position, its
    ratio fades toward the leave-one-out figure (10% a verify, after 10 verifies)."""
    planner = SpeculationPlanner("adaptive", 8, link_bytes_per_s=1e6)
    for _ in range(2):  # alone: the second position 1.67x the first
        verified(planner, [trace(2, (3000, 5000), further=3000)], 0.02)
    assert planner.inputs(planner.track()).prefix_fetch_bytes[7] == pytest.approx(3000 + 7 * 5000, rel=0.01)
    for _ in range(10):  # a batch of 31 plain rounds: one more token adds a third of the first's
        verified(planner, [trace(1, (3000,), further=1000)] * 31, 0.07)
    assert planner.inputs(planner.track()).prefix_fetch_bytes[1] == pytest.approx(8000, rel=0.01)  # not yet
    for _ in range(50):
        verified(planner, [trace(1, (3000,), further=1000)] * 31, 0.07)
    prefix = planner.inputs(planner.track()).prefix_fetch_bytes
    assert prefix[1] - prefix[0] == pytest.approx(1000, rel=0.05)
    assert prefix[7] == pytest.approx(3000 + 7 * 1000, rel=0.05)
    verified(planner, [trace(2, (3000, 1500), further=1000)] * 31, 0.07)  # measured again: it counts
    assert planner.inputs(planner.track()).prefix_fetch_bytes[1] - 3000 > 1000


def test_a_greedy_sequence_drafts_the_whole_block_whatever_it_verifies():
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    assert [planner.drafted_tokens(b, greedy=True) for b in (1, 2, 3, 4)] == [1, 4, 4, 4]
    assert planner.drafted_tokens(2, greedy=False) == 2  # a sampled block drafts what it plans (a cut only shortens)
    assert SpeculationPlanner("fixed", 4, link_bytes_per_s=1e6).drafted_tokens(4, greedy=True) == 4


def test_the_acceptance_calibration_follows_what_drafted_rounds_realized():
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    assert planner.acceptance_calibration == 1.0  # nothing drafted yet: the estimates as they are
    for _ in range(200):  # the estimates expected 2 drafts accepted a round; 1 was
        planner.observe_committed(expected_tokens=3.0, committed=2)
    assert planner.acceptance_calibration == pytest.approx(0.5, abs=0.01)
    verified(planner, [trace(1, (1000,), further=300)] * 2, 0.02)
    verified(planner, [trace(1, (1000,), further=300)] * 2, 0.02)
    assert planner.inputs(planner.track()).acceptance_calibration == planner.acceptance_calibration
    for _ in range(200):  # and it recovers when drafts accept as expected again
        planner.observe_committed(expected_tokens=3.0, committed=3)
    assert planner.acceptance_calibration == pytest.approx(1.0, abs=0.01)


def test_the_sequences_planning_between_two_verifies_decide_on_one_draw():
    """Alike sequences decide alike within a round of planning (a batch priced as if all chose as
    one does stays whole); the next verify brings a new draw, so over rounds they still explore."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e5)
    planner.observe_draft(2, 0.004)
    for _ in range(2):
        verified(planner, [trace(4, (1000, 600, 600, 600), further=600)] * 2, 0.02)
    seqs = [planner.track() for _ in range(4)]
    rounds = []
    for _ in range(100):
        rounds.append({planner.plan(seq) for seq in seqs})
        verified(planner, [trace(1, (1000,), further=600)] * 4, 0.02)
    assert all(len(blocks) == 1 for blocks in rounds), rounds  # every round: one block for all four
    assert len(set().union(*rounds)) > 1, rounds  # across rounds, the draws differ


def test_a_rounds_prices_are_kept_until_the_next_measurement_and_no_longer():
    """The sequences of a batch plan on one set of prices; each measurement that moves them (a
    verify, its refit, a drafter call, a launch gap) is in the next sequence's inputs."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=1e6)
    for _ in range(2):
        verified(planner, [trace(1, (1000,), further=300)] * 2, 0.02)
    seq = planner.track()
    first = planner.inputs(seq)
    assert planner.inputs(planner.track()).costs is first.costs  # built once for the round
    planner.observe_idle(0.010)
    idle = planner.inputs(seq)
    assert idle.costs.round_s == pytest.approx(first.costs.round_s + 0.010 / 2)
    planner.observe_draft(2, 0.004)
    assert planner.inputs(seq).costs.draft_s > idle.costs.draft_s == 0
    verified(planner, [trace(1, (3000,), further=300)] * 2, 0.02)
    assert planner.inputs(seq).prefix_fetch_bytes[0] > first.prefix_fetch_bytes[0]


# rounds of one kind whose decayed count reaches REALIZED_ROUNDS (a realized rate is trusted)
REALIZED_ROUNDS_NEEDED = next(n for n in count(1) if (1 - REALIZED_DECAY**n) / (1 - REALIZED_DECAY) >= REALIZED_ROUNDS)


def drafting_planner() -> tuple[SpeculationPlanner, SequenceAcceptance]:
    """A resident planner whose fitted costs and acceptance make a block of 4 its choice."""
    planner = SpeculationPlanner("adaptive", 4, link_bytes_per_s=None, routing=BUNDLED)
    planner.observe_draft(1, 0.001)
    for tokens in (1, 4, 1, 4):
        verified(planner, [trace(tokens, (0,) * tokens)] * 4, 0.010 + 0.0002 * tokens)
    seq = planner.track()
    for _ in range(30):
        seq.observe(4, 3)  # every draft accepted
    assert choose_block(planner.inputs(seq)).block == 4
    return planner, seq


def test_realized_rounds_keep_a_planner_plain_where_its_blocks_commit_less_per_second():
    """Fitted costs can favour blocks that, every sequence drafting, commit fewer tokens per second
    than plain rounds did (c = 32 resident on the bundled pair: 791 tok/s drafting, 934 plain): the
    rounds' realized rates overrule the fit until the blocks' rate is stale."""
    planner, seq = drafting_planner()
    planner.observe_round(4, 3, 0.080)  # a block round first: the plain rounds after it are compared
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(1, 1, 0.020)  # plain: 50 tokens/s a sequence
        planner.observe_round(4, 3, 0.080)  # blocks: 37.5
    assert planner.drafting_loses
    assert set(planned(planner, seq, 50, greedy=True)) == {1} and planner.vetoed == 50
    for _ in range(REALIZED_STALE - 1):
        planner.observe_round(1, 1, 0.020)
    assert planner.drafting_loses  # the blocks' rate still stands
    planner.observe_round(1, 1, 0.020)
    assert not planner.drafting_loses  # stale: dropped, so the policy drafts and measures again
    assert set(planned(planner, seq, 50, greedy=True)) == {4}


def test_realized_rounds_leave_the_policy_be_where_blocks_commit_more_per_second():
    planner, seq = drafting_planner()
    planner.observe_round(4, 3, 0.040)  # a block round first: the plain rounds after it are compared
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(1, 1, 0.020)
    assert not planner.drafting_loses  # too few blocks measured: nothing to compare
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(4, 3, 0.040)  # 75 tokens/s against 50
    assert not planner.drafting_loses
    assert set(planned(planner, seq, 50, greedy=True)) == {4} and planner.vetoed == 0


def test_plain_rounds_before_the_first_block_round_are_not_compared():
    """A cold engine's first rounds are plain (a link, nothing priced yet) and run in batches still
    forming, faster per sequence than the full batches its blocks then run in (c = 32: 6.9
    against 5.7 tokens/s a sequence-round); compared, they vetoed ~60 block rounds at every start."""
    planner, seq = drafting_planner()
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(1, 1, 0.010)  # 100 tokens/s a sequence, before any block round
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(4, 3, 0.040)  # 75
    assert not planner.drafting_loses and set(planned(planner, seq, 20, greedy=True)) == {4}
    for _ in range(REALIZED_ROUNDS_NEEDED):
        planner.observe_round(1, 1, 0.010)  # after the first block round they count
    assert planner.drafting_loses


def test_a_few_rounds_are_not_yet_a_realized_rate():
    planner, _ = drafting_planner()
    for _ in range(REALIZED_ROUNDS_NEEDED - 1):
        planner.observe_round(1, 1, 0.010)
        planner.observe_round(4, 1, 1.0)
    assert not planner.drafting_loses


def test_fixed_speculation_never_asks_the_policy():
    planner = SpeculationPlanner("fixed", 4, link_bytes_per_s=None)
    planner.observe_draft(1, 0.004)
    verified(planner, [trace(4, (0, 0, 0, 0))], 0.02)
    assert planner.plan(planner.track()) == 4 and planner.decisions == {4: 1}
    with pytest.raises(ValueError, match="speculation='greedy'"):
        SpeculationPlanner("greedy", 4, None)


@pytest.mark.asyncio
async def test_link_bound_at_concurrency_one_the_engine_decodes_plainly(make_engine, reference):
    async with make_engine(provider=SlowLink()) as engine:
        assert engine.planner.adaptive
        ids, _, last = await collect(engine.generate(PROMPTS[0], GREEDY))
        stats = await drained(engine)
    assert ids == reference(PROMPTS[0])  # lossless whatever the block
    blocks = last.metrics.block_sizes
    assert blocks[0] == 1  # nothing measured yet: plain decoding
    # then bytes cost more than the (random) tiny drafter's tokens are worth: short probes
    # now and then (its acceptance estimate drifts back to the prior), plain decoding mostly
    later = blocks[1:]
    assert max(later) <= 3 and later.count(1) >= 2 * len(later) / 3, blocks
    assert stats.block_decisions[1] == blocks.count(1) and stats.speculation == "adaptive"


@pytest.mark.asyncio
async def test_each_verified_round_reports_its_block_tokens_and_seconds_to_the_planner(make_engine):
    """What `drafting_loses` compares comes from the engine's verifies: every round of a sequence
    after its first (timed from the verify before it), alone in its batches, so all of one kind."""
    async with make_engine() as engine:
        rounds: list[tuple[int, int, float]] = []
        observe = engine.planner.observe_round
        engine.planner.observe_round = lambda *args: (rounds.append(args), observe(*args))[1]
        _, _, last = await collect(engine.generate(PROMPTS[1], GREEDY))
        await drained(engine)
    m = last.metrics
    assert [(b, a) for b, a, _ in rounds] == list(zip(m.block_sizes, m.acceptance_lengths, strict=True))[1:]
    assert len(rounds) >= 2 and all(seconds > 0 for _, _, seconds in rounds)


@pytest.mark.asyncio
async def test_short_blocks_draft_the_whole_block_and_read_the_rest_as_shadow_drafts(make_engine, reference):
    """A block of 2 verifies one draft; the drafter drafted all of them in its forward, and the
    rest reach the sequence as shadow drafts, read against the tokens it commits next."""
    engine = make_engine(provider=SlowLink())
    engine.planner.plan = lambda acceptance, greedy=False: 2
    engine.planner.cut = lambda acceptance, block, greedy=False: None  # the planned block stands
    drafts = []
    draft_rounds = engine._work.draft_rounds  # what the drafter lane runs, recorded
    engine._work.draft_rounds = lambda batch: drafts.extend(out := draft_rounds(batch)) or out
    async with engine:
        ids, _, last = await collect(engine.generate(PROMPTS[0], GREEDY))
    assert ids == reference(PROMPTS[0])  # lossless
    block = engine.speculator.block_size
    assert set(last.metrics.block_sizes[:-1]) == {2}
    assert len(drafts) == len(last.metrics.block_sizes)
    early = drafts[: len(drafts) // 2]  # far from the request's end, where a block is cut to what is left
    assert early and all(len(d.block) == 2 and len(d.block) + len(d.shadow) == block for d in early)
    assert engine.planner.acceptance._global.trials[0] > 0


def planned_three_and_recorded(engine) -> tuple[list, list]:
    """Every round of `engine` plans a block of 3; returns the lists its cuts (as the planner made
    them) and its drafted rounds (as the drafter lane returned them) are appended to."""
    engine.planner.plan = lambda acceptance, greedy=False: 3
    cuts, drafts = [], []
    cut = engine.planner.cut
    engine.planner.cut = lambda *args, **kwargs: cuts.append(out := cut(*args, **kwargs)) or out
    draft_rounds = engine._work.draft_rounds
    engine._work.draft_rounds = lambda batch: drafts.extend(out := draft_rounds(batch)) or out
    return cuts, drafts


@pytest.mark.asyncio
async def test_the_engine_verifies_as_far_as_each_rounds_cut_chooses_from_its_drafts(make_engine, reference):
    """Behind a link, every greedy drafted round is cut on the drafter lane by the cut its plan
    made, from the drafter's confidence in each draft; what it verifies teaches the confidence table."""
    engine = make_engine(provider=SlowLink())
    cuts, drafts = planned_three_and_recorded(engine)
    async with engine:
        ids, _, last = await collect(engine.generate(PROMPTS[0], GREEDY))
    assert ids == reference(PROMPTS[0])  # lossless
    assert len(cuts) == len(drafts) == len(last.metrics.block_sizes)
    priced = [(c, d) for c, d in zip(cuts, drafts, strict=True) if c is not None]
    assert priced, "no round was cut"  # none is priced before a verify is measured; the later ones are
    for c, d in priced:
        assert len(d.confidence) == len(d.block) + len(d.shadow) - 1
        assert len(d.block) == min(c.block(d.confidence), len(d.confidence) + 1)
    assert sum(engine.planner.confidence._trials) > 0


@pytest.mark.asyncio
async def test_unseeded_sampled_rounds_are_cut_by_the_peaks_of_their_q_and_penalized_ones_are_not(make_engine):
    """An unseeded sampled round drafts its planned block and is cut within it by the peak of each q
    its drafts were drawn from; its verifies teach the sampled table, not the greedy one. A
    penalized request keeps its planned block."""
    engine = make_engine(provider=SlowLink())
    cuts, drafts = planned_three_and_recorded(engine)
    drawn = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9)
    async with engine:
        await collect(engine.generate(PROMPTS[0], GREEDY))  # a verify measured: later rounds are priced
        cuts.clear(), drafts.clear()
        *_, last = await collect(engine.generate(PROMPTS[1], drawn))
        priced = [(c, d) for c, d in zip(cuts, drafts, strict=True) if c is not None]
        assert priced and len(cuts) == len(drafts) == len(last.metrics.block_sizes)
        for c, d in priced:
            assert d.shadow == () and len(d.confidence) == len(d.block) - 1 and len(d.block) <= 3
            assert d.draft_probs is not None and d.draft_probs.shape[0] == len(d.block) - 1
            assert d.confidence == pytest.approx(d.draft_probs.max(dim=-1).values.tolist())
            assert c.block(d.confidence) <= len(d.block)  # the cut's choice (or less, where the end clipped it)
        early = priced[: len(priced) // 2]  # far from the request's end: the cut alone decided
        assert early and all(c.block(d.confidence) == len(d.block) for c, d in early)
        assert sum(engine.planner.sampled_confidence._trials) > 0
        cuts.clear(), drafts.clear()
        penalized = SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2)
        *_, last = await collect(engine.generate(PROMPTS[1], penalized))
        assert all(c is None for c in cuts) and all(d.confidence == () for d in drafts)
        assert set(last.metrics.block_sizes[:-1]) <= {3}


@pytest.mark.asyncio
async def test_fixed_speculation_keeps_the_whole_block(make_engine, reference):
    async with make_engine(provider=SlowLink(), speculation="fixed") as engine:
        ids, _, last = await collect(engine.generate(PROMPTS[0], GREEDY))
    assert ids == reference(PROMPTS[0])
    emitted = [1]  # the prefill's token, then each round's
    for n in last.metrics.acceptance_lengths:
        emitted.append(emitted[-1] + n)
    budget = GREEDY.max_tokens
    block = engine.speculator.block_size
    assert last.metrics.block_sizes == tuple(min(block, budget - e + 1) for e in emitted[:-1])  # only clipped


@pytest.mark.asyncio
async def test_a_seeded_sampled_request_keeps_the_whole_block_and_reproduces(make_engine):
    """Adaptive choices depend on timing; a seed must not: seeded sampled rounds keep the block."""
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    async with make_engine(provider=SlowLink()) as engine:
        first = await collect(engine.generate(PROMPTS[0], seeded))
        await collect(engine.generate(PROMPTS[1], GREEDY))  # moves the planner's estimates
        again = await collect(engine.generate(PROMPTS[0], seeded))
    assert first[0] == again[0]
    block = engine.speculator.block_size
    for _, _, last in (first, again):
        emitted = [1]
        for n in last.metrics.acceptance_lengths:
            emitted.append(emitted[-1] + n)
        assert last.metrics.block_sizes == tuple(min(block, 12 - e + 1) for e in emitted[:-1])


def test_a_draft_that_first_catches_up_on_skipped_context_is_not_timed(loaded, drafter):
    """After plain-decoding rounds the drafter first reads the target context it skipped: a one-off
    cost that would make drafting every round look dearer than it is."""
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    planner = SpeculationPlanner("adaptive", spec.block_size, link_bytes_per_s=None)
    work = RoundWork(spec, planner)
    [session] = spec.begin_sessions([(PROMPTS[1], SamplingParams(max_tokens=40))])
    seq = SimpleNamespace(session=session, planned_block=1, planned_draft=1, planned_cut=None)  # what the lane reads
    while session.unseen_tokens <= spec.block_size:
        work.draft_rounds([seq])  # plain rounds: the drafter skipped, its unseen context grows
        spec.verify_rounds([session])
    seq.planned_block = seq.planned_draft = spec.block_size
    work.draft_rounds([seq])
    assert planner.draft_s == 0  # caught up, not timed
    spec.verify_rounds([session])
    work.draft_rounds([seq])
    assert planner.draft_s > 0  # a steady draft is
