"""Sampled rounds through the Speculator: seeded requests reproduce, batching changes nothing, q survives a rewind."""

import pytest
import torch

from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 63)), [7], [100, 101, 102, 103, 104, 105]]


@pytest.fixture(scope="module")
def loaded(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module")
def drafter(loaded, tiny_target, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target), loaded.model)


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=seed, **kw)


@pytest.mark.parametrize("block_size", [4, 8])
def test_seeded_sampled_requests_reproduce_alone_or_batched(loaded, drafter, block_size):
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, block_size=block_size)
    params = [sampled(i) for i in range(len(PROMPTS) - 1)] + [SamplingParams(max_tokens=24)]  # one greedy among them
    alone = [speculative_generate(spec, p, sp) for p, sp in zip(PROMPTS, params)]
    again = [speculative_generate(spec, p, sp) for p, sp in zip(PROMPTS, params)]
    sessions = spec.begin_sessions(list(zip(PROMPTS, params)))
    while live := [s for s in sessions if not s.finished]:
        spec.draft_rounds(live)
        spec.verify_rounds(live)
    for session, first, second in zip(sessions, alone, again):
        assert first.token_ids == second.token_ids == tuple(session.emitted)
        assert first.acceptance_lengths == tuple(session.acceptance_lengths)
    assert sum(sum(r.acceptance_lengths) - len(r.acceptance_lengths) for r in alone[:-1]) > 0, "no draft accepted"


def test_a_sampled_draft_keeps_the_distribution_it_was_drawn_from(loaded, drafter):
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, block_size=6)
    hot, greedy = spec.begin_sessions([(PROMPTS[0], sampled(3)), (PROMPTS[1], SamplingParams(max_tokens=24))])
    hot_draft, greedy_draft = spec.draft_rounds([hot, greedy])
    q = hot_draft.draft_probs
    assert q is not None and q.shape == (5, loaded.model.config.vocab_size)
    assert torch.allclose(q.sum(dim=-1), torch.ones(5))
    assert (q.gather(1, torch.tensor(hot_draft.block[1:])[:, None]) > 0).all()  # each draft is in its q's support
    assert greedy_draft.draft_probs is None


def test_restore_replays_a_sampled_round_exactly(loaded, drafter):
    """A batch that failed is retried from snapshots: the replay draws the same drafts and tokens."""
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, block_size=4)
    session = spec.begin_session(PROMPTS[1], sampled(11))
    before_draft = session.snapshot()
    spec.draft_round(session)
    before_verify = session.snapshot()
    first = spec.verify_round(session)
    session.restore(before_verify)  # the pending draft, with its q, is back
    assert spec.verify_round(session).accepted_ids == first.accepted_ids
    session.restore(before_draft)
    assert spec.draft_round(session).block == before_verify.fields["pending"].block
    assert spec.verify_round(session).accepted_ids == first.accepted_ids


def test_sampled_logprobs_are_the_targets_raw_log_softmax(loaded, drafter):
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, block_size=4)
    result = speculative_generate(spec, PROMPTS[0], sampled(5, logprobs=2))
    session = spec.begin_session(PROMPTS[0], sampled(5, logprobs=2))
    while not session.finished:
        spec.draft_round(session)
        spec.verify_round(session)
    assert tuple(session.emitted) == result.token_ids
    sequence = torch.tensor(PROMPTS[0] + list(session.emitted))
    logits = loaded.model.forward([sequence], [loaded.model.new_cache()]).logits  # [L, V]
    expected = torch.log_softmax(logits.float(), dim=-1)[len(PROMPTS[0]) - 1 : -1]  # row i predicts emitted[i]
    for row, entry in zip(expected, session.logprobs, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
