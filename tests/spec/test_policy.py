"""The speculation policy and its acceptance estimates: hand-worked cases and the back-off/recovery loop."""

from __future__ import annotations

import math
import random

import attrs
import pytest

from pdflash.spec.acceptance import (
    CONFIDENCE_DECAY,
    CONFIDENCE_EDGES,
    CONFIDENCE_PRIOR_WEIGHT,
    AcceptanceModel,
    AcceptancePrior,
    ConfidenceCalibration,
    ConfidenceTable,
)
from pdflash.spec.policy import PolicyInputs, RoundCosts, VerifyCut, choose_block, expected_committed, round_cost_s

MB = 1_000_000
LIGHT_PRIOR = AcceptancePrior(prior=0.6, prior_weight=2.0)  # the estimator's dynamics, seen in few rounds


def per_token(round_s: float, token_s: float, draft_s: float, link: float | None, blocks: int = 8) -> RoundCosts:
    """Costs whose verify compute grows by `token_s` with each block token (b = 1 .. `blocks`)."""
    return RoundCosts(
        round_s=round_s,
        block_s=tuple(b * token_s for b in range(1, blocks + 1)),
        draft_s=draft_s,
        link_bytes_per_s=link,
    )


def test_expected_committed_is_one_plus_the_survival_sum():
    a = (0.8, 0.5, 0.25)
    assert expected_committed(a, 1) == 1.0
    assert expected_committed(a, 2) == pytest.approx(1.8)
    assert expected_committed(a, 4) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_a_calibration_weighs_the_drafts_at_what_they_realized():
    a = (0.8, 0.5, 0.25)
    assert expected_committed(a, 4, 0.5) == pytest.approx(1 + 0.5 * (0.8 + 0.4 + 0.1))
    # shared bytes, 0.9 acceptance: at the estimates a block pays; drafts realizing 30% of that do not
    prefix = tuple(MB + int(0.3 * MB) * (b - 1) for b in range(1, 9))
    costs = per_token(0.010, 0.001, 0.005, 10 * MB)
    inputs = PolicyInputs(acceptance=(0.9,) * 7, prefix_fetch_bytes=prefix, costs=costs)
    assert choose_block(inputs).block > 1
    calibrated = PolicyInputs(acceptance=(0.9,) * 7, prefix_fetch_bytes=prefix, costs=costs, acceptance_calibration=0.3)
    choice = choose_block(calibrated)
    assert choice.block == 1 and choice.rates[1] == pytest.approx((1 + 0.3 * 0.9) / round_cost_s(calibrated, 2))
    with pytest.raises(ValueError, match="acceptance_calibration is a ratio >= 0"):
        PolicyInputs(acceptance=(0.9,), prefix_fetch_bytes=(1, 2), costs=costs, acceptance_calibration=-0.1)


def test_link_bound_at_concurrency_one_decodes_plainly():
    # every position adds 1 MB at 10 MB/s: 0.1 s per token against 11 ms of compute
    inputs = PolicyInputs(
        acceptance=(0.7,) * 7,
        prefix_fetch_bytes=tuple(b * MB for b in range(1, 9)),
        costs=per_token(0.010, 0.001, 0.005, 10 * MB),
    )
    choice = choose_block(inputs)
    # b=1: 1 / (0.010 + 0.001 + 0.1) = 9.01 tok/s; b=2: 1.7 / (0.010 + 0.002 + 0.005 + 0.2) = 7.83
    assert choice.rates[0] == pytest.approx(1 / 0.111)
    assert choice.rates[1] == pytest.approx(1.7 / 0.217)
    assert choice.block == 1
    assert choice.expected_tokens == 1.0 and choice.cost_s == pytest.approx(0.111)


def test_once_the_drafter_runs_the_best_block_of_two_or_more_is_chosen():
    # as above: plain decoding is best, and among drafted blocks the shortest loses least
    inputs = PolicyInputs(
        acceptance=(0.7,) * 7,
        prefix_fetch_bytes=tuple(b * MB for b in range(1, 9)),
        costs=per_token(0.010, 0.001, 0.005, 10 * MB),
    )
    drafted = choose_block(inputs, shortest=2)
    # b=3: (1 + 0.7 + 0.49) / (0.010 + 0.003 + 0.005 + 0.3) = 6.89 tok/s, below b=2's 7.83
    assert drafted.block == 2 and drafted.tokens_per_s == pytest.approx(1.7 / 0.217)
    assert drafted.rates == choose_block(inputs).rates  # the same rates, a narrower choice
    with pytest.raises(ValueError, match="shortest must be a block length in 1..8"):
        choose_block(inputs, shortest=9)


def test_a_cut_verifies_the_drafts_the_drafter_is_sure_of():
    # link-bound: every further position adds 0.2 MB at 10 MB/s (20 ms) against 11 ms a round
    inputs = PolicyInputs(
        acceptance=(0.7,) * 7,
        prefix_fetch_bytes=tuple(MB + int(0.2 * MB) * (b - 1) for b in range(1, 9)),
        costs=per_token(0.010, 0.001, 0.005, 10 * MB),
    )
    table = ConfidenceTable(tuple(min(1.0, 0.05 + i / len(CONFIDENCE_EDGES)) for i in range(len(CONFIDENCE_EDGES) + 1)))
    cut = VerifyCut(inputs=inputs, table=table)
    sure, doubt = 0.999, 0.05  # the last bucket's acceptance is 1.0; the first's 0.05
    assert table.of((sure, doubt)) == (1.0, 0.05)
    # all sure: each position adds a token for 21 ms, the whole block pays
    assert cut.block((sure,) * 7) == 8
    # sure up to a doubtful third draft: b = 3 commits 3 tokens in 0.153 s (19.6 tok/s); b = 4
    # adds 0.05 tokens for 21 ms more (17.5 tok/s)
    a = table.of((sure, sure, doubt) + (sure,) * 4)
    rates = [expected_committed(a, b) / round_cost_s(attrs_evolve_sunk(inputs, a), b) for b in range(2, 9)]
    assert cut.block((sure, sure, doubt) + (sure,) * 4) == 3 == 2 + max(range(7), key=rates.__getitem__)
    # a doubtful first draft: the cut still verifies one draft (the drafter ran already)
    assert cut.block((doubt,) * 7) == 2
    # the drafter's cost is spent: the same inputs priced with it leave the choice unchanged
    costly = VerifyCut(inputs=attrs.evolve(inputs, costs=attrs.evolve(inputs.costs, draft_s=5.0)), table=table)
    assert costly.block((sure,) * 7) == 8
    # fewer drafts than the block (the request's last tokens): never past them
    assert cut.block((sure, sure)) == 3
    with pytest.raises(ValueError, match="at least one draft"):
        cut.block(())


def attrs_evolve_sunk(inputs: PolicyInputs, acceptance: tuple[float, ...]) -> PolicyInputs:
    return attrs.evolve(inputs, acceptance=acceptance, costs=attrs.evolve(inputs.costs, draft_s=0.0))


def test_confidence_starts_calibrated_and_learns_what_drafts_realized():
    calibration = ConfidenceCalibration()
    start = calibration.table()
    assert start.of((0.05, 0.55, 0.97, 0.995)) == pytest.approx((0.05, 0.55, 0.97, 0.995))
    # the drafter is sure (0.97) of drafts that are rejected half the time; its doubtful ones
    # (0.15) are all accepted; a verify reads drafts up to the first rejected one only
    for _ in range(200):
        calibration.observe((0.97, 0.97), accepted_drafts=1)  # the first accepted, the second rejected
        calibration.observe((0.15, 0.15, 0.15), accepted_drafts=3)
        calibration.observe((0.55, 0.55, 0.55), accepted_drafts=0)  # only the first draft was read
    sure, doubtful, middling = calibration.table().of((0.97, 0.15, 0.55))
    # each bucket's counts decay toward ~170-330 trials: its prior's 8 pseudo-trials still pull a little
    assert sure == pytest.approx(0.5, abs=0.05) and sure != 0.5
    assert doubtful == pytest.approx(1.0, abs=0.05) and doubtful < 1.0
    assert middling == pytest.approx(0.0, abs=0.05) and middling > 0.0
    assert calibration.table().of((0.35,)) == start.of((0.35,))  # a bucket never observed keeps its prior


def test_the_confidence_table_decays_each_draft_as_it_is_defined():
    """Kept as the newest draft's weight, the counts equal counts decayed at every draft, across a
    rescale of the weights too."""
    rng = random.Random(5)
    calibration = ConfidenceCalibration()
    trials, successes = [0.0] * (len(CONFIDENCE_EDGES) + 1), [0.0] * (len(CONFIDENCE_EDGES) + 1)
    for round_ in range(600):
        confidence = tuple(rng.random() for _ in range(rng.randint(1, 7)))
        accepted = rng.randint(0, len(confidence))
        calibration.observe(confidence, accepted)
        for k, c in enumerate(confidence[: accepted + 1]):  # the definition: decay all, then count
            trials = [t * CONFIDENCE_DECAY for t in trials]
            successes = [x * CONFIDENCE_DECAY for x in successes]
            bucket = sum(c >= edge for edge in CONFIDENCE_EDGES)
            trials[bucket] += 1.0
            successes[bucket] += 1.0 if k < accepted else 0.0
        if round_ == 300:  # the same state with weights near overflow: the next draft rescales them
            calibration._weight *= 1e100
            calibration._trials = [t * 1e100 for t in calibration._trials]
            calibration._successes = [x * 1e100 for x in calibration._successes]
    assert calibration._weight < 1e99  # rescaled
    w = CONFIDENCE_PRIOR_WEIGHT
    middles = [(lo + hi) / 2 for lo, hi in zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0))]
    expected = tuple((x + w * p) / (t + w) for x, t, p in zip(successes, trials, middles))
    assert calibration.table().acceptance == pytest.approx(expected, rel=1e-9)


def test_shared_bytes_make_short_blocks_pay_when_link_bound():
    # the second token's route is mostly the first's: 1 MB, then 0.1 MB per further position
    prefix = tuple(MB + int(0.1 * MB) * (b - 1) for b in range(1, 9))
    inputs = PolicyInputs(
        acceptance=(0.9, 0.6, 0.3, 0.1, 0.1, 0.1, 0.1),
        prefix_fetch_bytes=prefix,
        costs=per_token(0.010, 0.001, 0.005, 10 * MB),
    )
    choice = choose_block(inputs)
    rates = [expected_committed(inputs.acceptance, b) / round_cost_s(inputs, b) for b in range(1, 9)]
    assert choice.block == 1 + max(range(8), key=rates.__getitem__)
    assert 2 <= choice.block < 8  # worth speculating, not all the way


def test_resident_with_high_acceptance_drafts_the_whole_block():
    inputs = PolicyInputs(
        acceptance=(0.9,) * 7,
        prefix_fetch_bytes=(0,) * 8,
        costs=per_token(0.010, 0.0005, 0.003, None),
    )
    choice = choose_block(inputs)
    assert choice.block == 8
    assert choice.expected_tokens == pytest.approx((1 - 0.9**8) / 0.1)
    assert choice.tokens_per_s == pytest.approx(choice.expected_tokens / (0.010 + 8 * 0.0005 + 0.003))


def test_ties_go_to_the_shorter_block():
    inputs = PolicyInputs(
        acceptance=(0.0,),
        prefix_fetch_bytes=(0, 0),
        costs=per_token(0.01, 0.0, 0.0, None, blocks=2),
    )
    assert choose_block(inputs).block == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"acceptance": (0.5,), "prefix_fetch_bytes": (1, 2, 3)}, "2 acceptance estimates"),
        ({"acceptance": (1.5,), "prefix_fetch_bytes": (1, 2)}, "probabilities"),
        ({"acceptance": (), "prefix_fetch_bytes": ()}, "at least b = 1"),
        ({"acceptance": (0.5,), "prefix_fetch_bytes": (1, -2)}, "sizes >= 0"),
    ],
)
def test_bad_policy_inputs_say_what_is_wrong(kwargs, message):
    costs = per_token(0.01, 0.0, 0.0, None)
    with pytest.raises(ValueError, match=message):
        PolicyInputs(costs=costs, **kwargs)


def test_bad_costs_and_priors_say_what_is_wrong():
    with pytest.raises(ValueError, match="draft_s must be >= 0"):
        per_token(0.0, 0.0, -1.0, None)
    with pytest.raises(ValueError, match="block_s needs b = 1 .. B seconds, each >= 0"):
        RoundCosts(round_s=0.0, block_s=(0.001, -0.001), draft_s=0.0, link_bytes_per_s=None)
    with pytest.raises(ValueError, match="8 block lengths need as many block_s, got 2"):
        PolicyInputs(acceptance=(0.5,) * 7, prefix_fetch_bytes=(0,) * 8, costs=per_token(0.0, 0.0, 0.0, None, blocks=2))
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        per_token(0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="sequence_decay"):
        AcceptancePrior(sequence_decay=0.0)
    with pytest.raises(ValueError, match="accepted_drafts=8"):
        AcceptanceModel(8).for_sequence().observe(8, 8)


def test_estimates_start_at_the_prior_and_follow_observations():
    model = AcceptanceModel(4, LIGHT_PRIOR)
    seq = model.for_sequence()
    assert seq.estimate() == pytest.approx((0.6, 0.6, 0.6))
    for _ in range(60):
        seq.observe(4, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never seen
    a1, a2, a3 = seq.estimate()
    assert a1 > 0.9 and a2 < 0.15
    assert a3 == pytest.approx(model.global_estimate()[2])  # unobserved: the pooled estimate
    # nobody saw position 3: it is believed to accept as position 2, the last one observed, does
    pooled = model.global_estimate()
    assert pooled[2] == pytest.approx(pooled[1]) and pooled[2] < 0.15


def test_positions_no_round_reached_follow_the_last_observed_one():
    """Blocks of 2 see only position 1; an accepting drafter there is believed to accept later too."""
    model = AcceptanceModel(8, LIGHT_PRIOR)
    seq = model.for_sequence()
    for _ in range(30):
        seq.observe(2, 1)
    pooled = model.global_estimate()
    assert pooled[0] > 0.9 and pooled == pytest.approx((pooled[0],) * 7)


def test_a_run_of_rejections_backs_off_and_recovery_follows_acceptance():
    """Loop the estimator through the policy, deciding on draws as the engine does: rejections ->
    plain decoding; the pooled estimate keeps what it saw, but its posterior still has room, so a
    draw now and then probes, and once drafts are accepted again it returns to the whole block."""
    costs = per_token(0.010, 0.0005, 0.004, None)
    model = AcceptanceModel(8, LIGHT_PRIOR)
    seq = model.for_sequence()

    def block() -> int:
        model.next_draw()  # a round: the engine's verifies bring a new draw
        return choose_block(PolicyInputs(acceptance=seq.draw(), prefix_fetch_bytes=(0,) * 8, costs=costs)).block

    assert block() > 1  # the prior is worth speculating on
    for _ in range(10):  # the drafter stops matching
        seq.observe(8, 0)
    backed_off = []
    for _ in range(20):
        backed_off.append(block())
        seq.observe(1, 0)
    assert sum(b > 1 for b in backed_off) <= 4, backed_off  # mostly plain decoding
    chosen = []
    for _ in range(2000):  # plain decoding sees nothing; only the draws can send it back
        b = block()
        chosen.append(b)
        if b > 1:
            break
        seq.observe(1, 0)
    assert chosen[-1] > 1, "the policy never probed again"
    recent = []
    for _ in range(200):  # acceptance has returned: every draft is accepted
        b = block()
        seq.observe(b, b - 1)
        recent.append(b)
    assert recent[-10:] == [8] * 10, recent


def test_the_global_prior_carries_what_other_sequences_saw():
    model = AcceptanceModel(3, LIGHT_PRIOR)
    for _ in range(30):
        model.for_sequence().observe(3, 2)
    fresh = model.for_sequence()
    assert all(a > 0.9 for a in fresh.estimate())
    assert not math.isclose(fresh.estimate()[0], model.prior.prior)


def _draws(model: AcceptanceModel, n: int) -> list[tuple[float, ...]]:
    out = []
    for _ in range(n):
        model.next_draw()
        out.append(model.global_draw())
    return out


def test_posterior_draws_center_on_the_estimate_and_narrow_as_trials_accumulate():
    """Thompson sampling: the policy decides on draws whose mean is the pooled estimate and whose
    spread is what the observations leave uncertain."""
    few, many = AcceptanceModel(4), AcceptanceModel(4)
    for model, rounds in ((few, 4), (many, 400)):
        for _ in range(rounds):
            model.for_sequence().observe(4, 1)  # position 1 always accepted, position 2 never
    for model in (few, many):
        draws = _draws(model, 4000)
        for k in range(3):
            mean = sum(d[k] for d in draws) / len(draws)
            assert mean == pytest.approx(model.global_estimate()[k], abs=0.02)

    def spread(model: AcceptanceModel) -> float:
        first = [d[0] for d in _draws(model, 4000)]
        mean = sum(first) / len(first)
        return math.sqrt(sum((x - mean) ** 2 for x in first) / len(first))

    assert spread(few) > 3 * spread(many)
    model = AcceptanceModel(4)
    assert model.global_draw() is model.global_draw()  # one round of planning, one draw
    first = model.global_draw()
    model.next_draw()
    assert model.global_draw() != first
    # one seed, the same draws: a simulation replays the engine's decisions
    assert AcceptanceModel(4, seed=3).global_draw() == AcceptanceModel(4, seed=3).global_draw()
    assert AcceptanceModel(4, seed=3).global_draw() != AcceptanceModel(4, seed=4).global_draw()


def test_draws_probe_while_uncertain_and_stop_where_no_draw_can_pay():
    """Link-bound at one sequence, a drafter accepting 0.6 never pays: once that is well observed no
    draw makes a draft worth it, while fresh (the prior alone) some draws still probe. Resident,
    where the same drafter pays, nearly every draw drafts."""
    link_bound = per_token(0.010, 0.001, 0.005, 10 * MB)
    resident = per_token(0.010, 0.0005, 0.003, None)

    def drafted_share(model: AcceptanceModel, costs: RoundCosts, fetch: tuple[int, ...]) -> float:
        seq = model.for_sequence()
        blocks = []
        for _ in range(1000):
            model.next_draw()
            blocks.append(
                choose_block(PolicyInputs(acceptance=seq.draw(), prefix_fetch_bytes=fetch, costs=costs)).block
            )
        return sum(b > 1 for b in blocks) / len(blocks)

    per_position = tuple(b * MB // 5 for b in range(1, 9))  # 0.02 s of link per position
    observed, rng = AcceptanceModel(8), random.Random(0)
    for _ in range(300):  # each draft accepted with probability 0.6, given the ones before it were
        accepted = next((k for k in range(7) if rng.random() >= 0.6), 7)
        observed.for_sequence().observe(8, accepted)
    assert all(abs(a - 0.6) < 0.12 for a in observed.global_estimate()), observed.global_estimate()
    assert drafted_share(AcceptanceModel(8), link_bound, per_position) > 0.01  # fresh: it probes
    assert drafted_share(observed, link_bound, per_position) < 0.01  # known not to pay: it stops
    assert drafted_share(observed, resident, (0,) * 8) > 0.95
