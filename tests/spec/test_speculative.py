"""DFlash rounds: lossless greedy output, the round order, projections and their byte sums."""

import attrs
import pytest
import torch

from pdflash.errors import CheckpointError
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.projection import routed_union, union_bytes
from pdflash.spec.session import RoundOrderError
from pdflash.spec.speculator import Speculator, further_token_bytes, position_fetch_bytes, speculative_generate
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 63)), [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


@pytest.fixture(scope="module")
def loaded(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module")
def drafter(loaded, tiny_target, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target), loaded.model)


def speculator(loaded, drafter, **kw):
    return Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, **kw)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_speculative_equals_autoregressive(loaded, drafter, block_size):
    params = SamplingParams(max_tokens=40)
    spec = speculator(loaded, drafter, block_size=block_size)
    for prompt in PROMPTS:
        expected = generate_autoregressive(loaded.model, prompt, params).token_ids
        assert speculative_generate(spec, prompt, params).token_ids == expected


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_batched_rounds_equal_single_rounds(loaded, drafter, block_size):
    params = SamplingParams(max_tokens=30)
    spec = speculator(loaded, drafter, block_size=block_size)
    alone = [speculative_generate(spec, p, params) for p in PROMPTS]
    sessions = spec.begin_sessions([(p, params) for p in PROMPTS])
    while live := [s for s in sessions if not s.finished]:
        spec.draft_rounds(live)
        spec.verify_rounds(live)
    for session, single in zip(sessions, alone):
        assert tuple(session.emitted) == single.token_ids
        assert tuple(session.acceptance_lengths) == single.acceptance_lengths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompts_prefilled_inside_verifies_equal_separate_forwards(loaded, drafter, temperature):
    """A prompt joining a batched verify (one forward) gets the session a prefill alone gives, and the
    verified sessions the results they get alone: staggered arrivals, greedy and seeded sampling."""
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=11 + i) for i in range(len(PROMPTS))]
    spec = speculator(loaded, drafter, block_size=4)

    def run(mixed: bool) -> list[list[int]]:
        sessions = spec.begin_sessions([(PROMPTS[0], params[0])])
        arriving = list(range(1, len(PROMPTS)))
        while (live := [s for s in sessions if not s.finished]) or arriving:
            joining = [arriving.pop(0)] if arriving else []
            requests = [(PROMPTS[i], params[i]) for i in joining]
            spec.draft_rounds(live, [3] * len(live))
            if mixed:
                results, begun = spec.verify_and_begin(live, requests)
            else:
                results, begun = spec.verify_rounds(live), spec.begin_sessions(requests)
            assert len(results) == len(live) and len(begun) == len(joining)
            sessions += begun
        return [s.emitted for s in sessions]

    assert run(mixed=True) == run(mixed=False)
    if temperature == 0.0:
        expected = [list(generate_autoregressive(loaded.model, p, params[0]).token_ids) for p in PROMPTS]
        assert run(mixed=True) == expected


def test_a_forward_mixing_prefills_and_verifies_gives_each_the_logits_rows_it_needs(loaded):
    model, cache_a, cache_b = loaded.model, loaded.model.new_cache(), loaded.model.new_cache()
    model.forward([torch.tensor(PROMPTS[1])], [cache_a])
    block, prompt = torch.tensor([3, 4, 5]), torch.tensor(PROMPTS[3])
    out = model.forward([block, prompt], [cache_a, cache_b], last_logits_only=[False, True])
    assert out.logit_lens == (3, 1) and out.logits.shape[0] == 4
    verify_rows, prefill_row = out.split_logits()
    alone_a, alone_b = loaded.model.new_cache(), loaded.model.new_cache()
    model.forward([torch.tensor(PROMPTS[1])], [alone_a])
    torch.testing.assert_close(verify_rows, model.forward([block], [alone_a]).logits)
    torch.testing.assert_close(prefill_row, model.forward([prompt], [alone_b], last_logits_only=True).logits)
    with pytest.raises(ValueError, match="1 flags for 2 sequences"):
        model.forward([block, prompt], [cache_a, cache_b], last_logits_only=[True])


def test_per_session_block_sizes_and_skipped_drafts_keep_the_output(loaded, drafter):
    """Rounds of varying size per session, 1 (no drafter forward) included, equal plain decoding:
    a session that skips the drafter keeps its unseen context for the next round that drafts."""
    params = SamplingParams(max_tokens=30)
    spec = speculator(loaded, drafter, block_size=8)
    expected = [generate_autoregressive(loaded.model, p, params).token_ids for p in PROMPTS]
    sessions = spec.begin_sessions([(p, params) for p in PROMPTS])
    plans = [[1, 1, 8, 3], [8], [2, 1], [1, 5, 1, 1, 8]]  # cycled per session
    rounds = 0
    while live := [s for s in sessions if not s.finished]:
        sizes = [plans[sessions.index(s)][rounds % len(plans[sessions.index(s)])] for s in live]
        drafts = spec.draft_rounds(live, sizes)
        assert [d.tokens for d in drafts] == [
            min(n, s.rule.max_new_tokens - len(s.emitted) + 1) for n, s in zip(sizes, live)
        ]
        results = spec.verify_rounds(live)
        for size, result in zip(sizes, results):
            assert len(result.trace.position_fetch_bytes) == result.trace.tokens <= size
        rounds += 1
    assert [tuple(s.emitted) for s in sessions] == expected
    with pytest.raises(ValueError, match="1..8 tokens, got 9"):
        spec.draft_rounds(spec.begin_sessions([(PROMPTS[0], params)]), [9])


class CutBelowMean:
    """Stands in for pdflash.spec.policy.VerifyCut (tested in tests/spec/test_policy.py): verifies
    the drafts up to the first one the drafter is less sure of than of the block on average (the
    tiny drafter's confidences are all ~0.02, so a real cut's table reads them alike)."""

    def block(self, confidence: tuple[float, ...]) -> int:
        mean = sum(confidence) / len(confidence)
        return 2 + next((k for k, c in enumerate(confidence[1:]) if c < mean), len(confidence) - 1)


def test_drafts_cut_by_the_drafters_confidence_keep_the_output(loaded, drafter):
    """Greedy rounds that draft the whole block and verify what a cut chooses from the drafter's
    confidence in each draft (its probability of the argmax it drafted) equal plain decoding; the
    drafts past the cut are the round's shadow. An unseeded sampled session is cut by the peaks of
    its q and keeps no shadow; a penalized one is not cut."""
    params = SamplingParams(max_tokens=30)
    spec = speculator(loaded, drafter, block_size=8)
    expected = [generate_autoregressive(loaded.model, p, params).token_ids for p in PROMPTS]
    cut = CutBelowMean()
    sessions = spec.begin_sessions([(p, params) for p in PROMPTS])
    lengths = set()
    while live := [s for s in sessions if not s.finished]:
        drafts = spec.draft_rounds(live, [2] * len(live), [8] * len(live), [cut] * len(live))
        for s, d in zip(live, drafts, strict=True):
            room = s.rule.max_new_tokens - len(s.emitted) + 1
            assert len(d.confidence) == min(8, room) - 1 and all(0.0 < c <= 1.0 for c in d.confidence)
            assert d.tokens == min(cut.block(d.confidence), room) and d.tokens + len(d.shadow) == min(8, room)
            lengths.add(d.tokens)
        spec.verify_rounds(live)
    assert [tuple(s.emitted) for s in sessions] == expected
    assert len(lengths) >= 3  # the confidence, not the planned 2, decided
    drawn = SamplingParams(max_tokens=30, temperature=0.8)
    sampled = spec.begin_sessions([(PROMPTS[0], drawn), (PROMPTS[1], attrs.evolve(drawn, repetition_penalty=1.3))])
    asked = Asked(3)
    d, penalized = spec.draft_rounds(sampled, [8, 3], None, [asked, asked])
    assert len(asked.confidence) == 1 and len(asked.confidence[0]) == 7  # asked once, with every draft's peak
    assert d.tokens == 3 and d.shadow == () and d.confidence == asked.confidence[0][:2]
    assert d.draft_probs.shape[0] == 2 and d.confidence == pytest.approx(d.draft_probs.max(dim=-1).values.tolist())
    assert penalized.tokens == 3 and penalized.confidence == ()


class Asked:
    """Stands in for a VerifyCut: records the confidences it is asked about and verifies `block`."""

    def __init__(self, block: int) -> None:
        self.verify, self.confidence = block, []

    def block(self, confidence: tuple[float, ...]) -> int:
        self.confidence.append(confidence)
        return self.verify


def test_position_bytes_share_each_expert_among_the_batch_that_routed_it(loaded, drafter):
    spec = speculator(loaded, drafter, block_size=4)
    params = SamplingParams(max_tokens=8)
    sessions = spec.begin_sessions([(PROMPTS[0], params), (PROMPTS[0], params)])
    spec.draft_rounds(sessions)
    twins = spec.verify_rounds(sessions)  # the same prompt twice: every expert is shared by both
    halves = [sum(r.trace.position_fetch_bytes) for r in twins]
    assert (
        halves[0]
        == halves[1]
        == pytest.approx(twins[0].trace.actual_bytes / 2, abs=len(twins[0].trace.position_fetch_bytes))
    )
    alone = spec.begin_sessions([(PROMPTS[1], params)])
    spec.draft_rounds(alone)
    [result] = spec.verify_rounds(alone)
    # alone and nothing resident: the positions add up to the union the verify routed
    assert sum(result.trace.position_fetch_bytes) == result.trace.actual_bytes
    assert result.trace.position_fetch_bytes[0] > 0


def test_a_position_pays_for_what_the_batch_adds_by_reaching_it(loaded, drafter):
    """Base = every session's first token (what plain decoding fetches anyway); position k pays
    for what no earlier position of any session brought, shared among the sessions whose
    position k routed it."""
    spec = speculator(loaded, drafter, block_size=4)
    (a, b, c, d, r), nbytes = [(0, e) for e in range(5)], spec.expert_nbytes[(0, 0)]
    assert all(spec.expert_nbytes[k] == nbytes for k in (a, b, c, d, r))
    residents = [frozenset({r}), frozenset()]
    routes = [
        [frozenset({a, r}), frozenset({b, c}), frozenset({b})],  # r resident; b again: paid once
        [frozenset({a}), frozenset({a, c}), frozenset({d})],  # a is the base's; c shared with the other
    ]
    first, second = position_fetch_bytes(residents, routes, spec.expert_nbytes)
    assert first == (nbytes // 2, nbytes + nbytes // 2, 0)
    assert second == (nbytes // 2, nbytes // 2, nbytes)
    assert sum(first + second) == 4 * nbytes  # a, b, c, d: what the batch fetched
    # one more token routed like its first would add nothing beyond the other's base (a), and alone
    # it would add its first token's misses
    assert further_token_bytes(residents, routes, spec.expert_nbytes) == [0, 0]
    assert further_token_bytes(residents[:1], routes[:1], spec.expert_nbytes) == [nbytes]
    # r reached at position 1 by one session and at position 3 by the other: the batch fetched it
    # because blocks reached position 1, so position 3 adds nothing (a later block is cheap when
    # the batch's earlier positions already bring its experts)
    routes = [[frozenset({a}), frozenset({r})], [frozenset({b}), frozenset({c}), frozenset({d}), frozenset({r})]]
    first, second = position_fetch_bytes([frozenset(), frozenset()], routes, spec.expert_nbytes)
    assert first == (nbytes, nbytes)
    assert second == (nbytes, nbytes, nbytes, 0)


def test_trained_like_drafter_accepts_more_than_one(loaded, drafter):
    """A drafter that is told the target's own next tokens is fully accepted (sanity of acceptance)."""
    params = SamplingParams(max_tokens=24)
    truth = generate_autoregressive(loaded.model, PROMPTS[1], params).token_ids
    spec = speculator(loaded, drafter, block_size=4)
    session = spec.begin_session(PROMPTS[1], params)
    spec.draft_round(session)
    position = len(session.emitted)
    session.pending = session.pending.__class__(
        block=(session.anchor, *truth[position : position + 3]),
        expert_union=frozenset(),
        expert_bytes=0,
        fetch_bytes=0,
        projection_s=0.0,
    )
    result = spec.verify_round(session)
    assert result.accepted_drafts == 3 and list(result.accepted_ids) == list(truth[position : position + 4])


def test_misordered_rounds_raise(loaded, drafter):
    spec = speculator(loaded, drafter)
    session = spec.begin_session(PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(RoundOrderError, match="without a pending draft"):
        spec.verify_round(session)
    spec.draft_round(session)
    with pytest.raises(RoundOrderError, match="twice without a verify"):
        spec.draft_round(session)
    while not session.finished:
        if session.pending is None:
            spec.draft_round(session)
        spec.verify_round(session)
    with pytest.raises(RoundOrderError, match="finished session"):
        spec.draft_round(session)
    with pytest.raises(RoundOrderError, match="finished session"):
        spec.verify_round(session)


def test_first_token_stop_finishes_session(loaded, drafter):
    first = generate_autoregressive(loaded.model, PROMPTS[0], SamplingParams(max_tokens=1)).token_ids[0]
    spec = speculator(loaded, drafter)
    session = spec.begin_session(PROMPTS[0], SamplingParams(max_tokens=10, stop_token_ids=[first]))
    assert session.finished and session.finish_reason == "stop" and session.emitted == [first]


def test_stop_token_truncates_right_after_it(loaded, drafter):
    params = SamplingParams(max_tokens=30)
    full = generate_autoregressive(loaded.model, PROMPTS[1], params).token_ids
    stop = full[10]
    cut = full[: full.index(stop) + 1]
    result = speculative_generate(
        speculator(loaded, drafter), PROMPTS[1], SamplingParams(max_tokens=30, stop_token_ids=[stop])
    )
    assert result.token_ids == cut and result.finish_reason == "stop"


def test_projection_bytes_are_exact_sums(loaded, drafter):
    spec = speculator(loaded, drafter, projector="router")
    session = spec.begin_session(PROMPTS[1], SamplingParams(max_tokens=8))
    draft = spec.draft_round(session)
    assert draft.expert_union
    assert draft.expert_bytes == sum(loaded.expert_nbytes[k] for k in draft.expert_union)
    assert draft.fetch_bytes == draft.expert_bytes  # nothing is device-resident without a cache


def test_exact_projector_has_full_coverage(loaded, drafter):
    spec = speculator(loaded, drafter, projector="exact")
    result = speculative_generate(spec, PROMPTS[1], SamplingParams(max_tokens=24))
    assert result.stats["projection_coverage"] == 1.0
    assert result.stats["projection_waste_bytes"] == 0


@pytest.mark.parametrize("projector", ["router", "last-union"])
def test_projectors_record_coverage_and_waste(loaded, drafter, projector):
    result = speculative_generate(
        speculator(loaded, drafter, projector=projector), PROMPTS[1], SamplingParams(max_tokens=24)
    )
    assert 0.0 < result.stats["projection_coverage"] <= 1.0
    assert result.stats["projection_waste_bytes"] >= 0
    assert result.stats["verify_s"] > 0 and result.stats["projection_s"] > 0


def test_routed_union_and_bytes(loaded):
    routed = torch.tensor([[[1, 2], [3, 1]], [[2, 1], [0, 3]]])  # [n=2, L=2, K=2]
    union = routed_union(routed, [0, 2])
    assert union == {(0, 1), (0, 2), (2, 3), (2, 1), (2, 0)}
    assert union_bytes(union, {k: 10 for k in union}) == 50


def test_unknown_projector_is_named(loaded, drafter):
    with pytest.raises(
        ValueError, match="projector 'psychic' is unknown; choose one of last-union, router, exact, route-head"
    ):
        speculator(loaded, drafter, projector="psychic")


def test_autoregressive_mode_is_block_of_one(loaded):
    spec = Speculator(loaded.model, None, expert_nbytes=loaded.expert_nbytes)
    params = SamplingParams(max_tokens=20)
    result = speculative_generate(spec, PROMPTS[0], params)
    assert result.token_ids == generate_autoregressive(loaded.model, PROMPTS[0], params).token_ids
    assert set(result.acceptance_lengths) == {1}


@pytest.mark.parametrize(
    "override, message",
    [
        ({"hidden_size": 32}, "hidden_size 32 != target hidden_size 64"),
        ({"vocab_size": 100}, "vocab_size 100 != target vocab_size 264"),
        ({"block_size": 1}, "block_size 1 must be >= 2"),
        ({"dflash_config": {"mask_token_id": 5000}}, "mask_token_id 5000 is not below the target vocab_size 264"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 9]}}, r"target_layer_ids \[9\] are not below"),
    ],
)
def test_mismatched_drafter_is_rejected(loaded, tiny_target, tmp_path, override, message):
    d = write_tiny_drafter(tmp_path / "d", tiny_target, **override)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(d, loaded.model)


def test_fc_shape_mismatch_is_rejected(loaded, tiny_target, tmp_path):
    import json

    d = write_tiny_drafter(tmp_path / "d", tiny_target, num_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"fc.in_features 128 != 3 taps x hidden_size 64"):
        load_drafter(d, loaded.model)
