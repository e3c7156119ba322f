"""Rejection sampling over hand-built p and q: every block position keeps the target's distribution.

Many independent trials run as one batch through the pure `accept`. At block position k, the
trials whose round reached k (drafts 0 … k-1 accepted) emit draft k or the resampled token;
those must follow p_k exactly (chi-square), and draft k must be accepted at the optimal rate
Σ min(p_k, q_k) (a rule that always rejected and sampled p would keep p but accept nothing).
The same checks run on two wrong rules show they can fail.
"""

import pytest
import torch
from chi_square import chi_square

from pdflash.sampling import SamplingParams, adjust_logits, probabilities
from pdflash.spec import rejection

VOCAB, BLOCK, TRIALS = 10, 4, 200_000
DRAFTS = BLOCK - 1
SETTINGS = {
    "plain": SamplingParams(temperature=1.0),
    "top-k": SamplingParams(temperature=0.8, top_k=4),
    "top-p": SamplingParams(temperature=1.2, top_p=0.7),
}


def hand_built(params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """p [b, V] and q [b-1, V] under `params`: the drafter's logits are the target's plus noise,
    so the supports overlap but differ (top-k / top-p cut each side in different places)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(BLOCK, VOCAB, generator=g) * 1.5
    draft = target[:DRAFTS] + torch.randn(DRAFTS, VOCAB, generator=g)
    return probabilities(target, params), probabilities(draft, params)


def trials(p, q, n=TRIALS, seed=1, counts=None):
    """n independent blocks: drafts drawn from q, uniforms drawn fresh → the tensors `accept` takes."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[k], n, replacement=True, generator=g) for k in range(DRAFTS)], 1)
    counts = torch.full((n,), DRAFTS) if counts is None else counts
    return (
        p.expand(n, -1, -1),  # [n, b, V]
        q.expand(n, -1, -1),  # [n, d, V]
        drafts,  # [n, d]
        counts,  # [n]
        torch.rand(n, DRAFTS, generator=g),  # [n, d]
        torch.rand(n, generator=g),  # [n]
    )


def emitted_at(k, accepted, drafts, tokens):
    """Tokens the trials emit at block position k (only those whose round reached k)."""
    reached = accepted >= k
    at_k = torch.where(accepted[reached] > k, drafts[reached, min(k, DRAFTS - 1)], tokens[reached])
    return at_k, reached


def check_positions(p, q, accepted, drafts, tokens):
    """Per block position: (chi-square against p_k, acceptance rate, its closed form, standard error)."""
    rows = []
    for k in range(BLOCK):
        at_k, reached = emitted_at(k, accepted, drafts, tokens)
        fit = chi_square(torch.bincount(at_k, minlength=VOCAB), p[k])
        if k < DRAFTS:
            rate = float((accepted[reached] > k).double().mean())
            optimal = float(torch.minimum(p[k], q[k]).sum())
            stderr = (optimal * (1 - optimal) / int(reached.sum())) ** 0.5
            rows.append((fit, rate, optimal, stderr))
        else:
            rows.append((fit, None, None, None))
    return rows


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_block_position_keeps_the_target_distribution(setting):
    p, q = hand_built(SETTINGS[setting])
    inputs = trials(p, q)
    accepted, tokens = rejection.accept(*inputs)
    for k, (fit, rate, optimal, stderr) in enumerate(check_positions(p, q, accepted, inputs[2], tokens)):
        assert fit.p_value > 1e-3, f"{setting}, block position {k}: {fit}"
        if rate is not None:
            assert abs(rate - optimal) < 5 * stderr, f"position {k}: acceptance {rate:.4f}, Σ min(p, q) = {optimal:.4f}"
    assert (accepted == DRAFTS).any() and (accepted == 0).any()  # bonus and first-position rejections both ran


def test_a_rule_resampling_from_p_or_keeping_every_draft_fails_the_same_check():
    """Tests of the test: two common mistakes are caught at the sample size used above."""
    p, q = hand_built(SETTINGS["top-k"])
    inputs = trials(p, q)
    accepted, _ = rejection.accept(*inputs)
    g = torch.Generator().manual_seed(2)
    from_p = torch.multinomial(p[accepted.clamp(max=BLOCK - 1)], 1, generator=g).squeeze(-1)  # not the residual
    fits = [fit for fit, *_ in check_positions(p, q, accepted, inputs[2], from_p)]
    assert min(f.p_value for f in fits) < 1e-6, [str(f) for f in fits]
    keep_all = torch.full_like(accepted, DRAFTS)  # every draft kept: the output is q's, not p's
    bonus = torch.multinomial(p[-1], TRIALS, replacement=True, generator=g)
    fits = [fit for fit, *_ in check_positions(p, q, keep_all, inputs[2], bonus)]
    assert min(f.p_value for f in fits[:DRAFTS]) < 1e-6, [str(f) for f in fits]


def test_the_old_equal_to_a_sample_rule_keeps_p_but_accepts_below_the_optimum():
    """Accepting a draft only when it equals an independent sample of p is lossless but accepts
    with Σ p·q < Σ min(p, q): the acceptance-rate check tells it from the rejection rule."""
    p, q = hand_built(SETTINGS["plain"])
    _, _, drafts, _, _, _ = trials(p, q)
    g = torch.Generator().manual_seed(3)
    posterior = torch.stack([torch.multinomial(p[k], TRIALS, replacement=True, generator=g) for k in range(BLOCK)], 1)
    accepted = (drafts == posterior[:, :DRAFTS]).long().cumprod(dim=1).sum(dim=1)
    tokens = posterior.gather(1, accepted[:, None]).squeeze(1)
    rows = check_positions(p, q, accepted, drafts, tokens)
    assert all(fit.p_value > 1e-3 for fit, *_ in rows)
    assert all(optimal - rate > 10 * stderr for _, rate, optimal, stderr in rows[:DRAFTS])


def test_padding_past_each_blocks_draft_count_is_ignored():
    """Blocks of 0 … 3 drafts in one batch, with adversarial padding (uniforms 0 would pass any test)."""
    p, q = hand_built(SETTINGS["top-p"], seed=4)
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, DRAFTS + 1, (TRIALS,), generator=g)
    target_probs, draft_probs, drafts, _, test_u, resample_u = trials(p, q, seed=6, counts=counts)
    beyond = torch.arange(DRAFTS) >= counts[:, None]  # [n, d]
    test_u = torch.where(beyond, 0.0, test_u)
    drafts = torch.where(beyond, torch.randint(0, VOCAB, drafts.shape, generator=g), drafts)
    accepted, tokens = rejection.accept(target_probs, draft_probs, drafts, counts, test_u, resample_u)
    assert (accepted <= counts).all()
    for count in range(DRAFTS + 1):
        alone = counts == count
        last = tokens[alone & (accepted == count)]  # the bonus after `count` accepted drafts comes from p
        assert chi_square(torch.bincount(last, minlength=VOCAB), p[count]).p_value > 1e-3
        for k in range(count + 1):
            reached = alone & (accepted >= k)
            at_k = torch.where(accepted[reached] > k, drafts[reached, min(k, DRAFTS - 1)], tokens[reached])
            fit = chi_square(torch.bincount(at_k, minlength=VOCAB), p[k])
            assert fit.p_value > 1e-3, f"{count} drafts, position {k}: {fit}"


def test_identical_distributions_accept_every_draft_and_point_masses_act_greedily():
    p, _ = hand_built(SETTINGS["plain"])
    accepted, _ = rejection.accept(*trials(p, p[:DRAFTS], n=1000))
    assert (accepted == DRAFTS).all()
    onehot = torch.nn.functional.one_hot(torch.tensor([[3, 5, 7, 1]]), VOCAB).float()  # [1, b, V] a greedy target
    drafts = torch.tensor([[3, 5, 2]])  # the third draft differs from the target's 7
    accepted, tokens = rejection.accept(
        onehot,
        torch.nn.functional.one_hot(drafts, VOCAB).float(),
        drafts,
        torch.tensor([3]),
        torch.rand(1, 3),
        torch.rand(1),
    )
    assert (int(accepted), int(tokens)) == (2, 7)


def test_mismatched_shapes_name_what_was_expected():
    with pytest.raises(ValueError, match=r"draft_probs must be \(2, 3, 10\)"):
        rejection.accept(
            torch.rand(2, 4, 10),
            torch.rand(2, 4, 10),
            torch.zeros(2, 3, dtype=torch.int64),
            torch.tensor([3, 3]),
            torch.rand(2, 3),
            torch.rand(2),
        )


def test_uniforms_of_a_request_do_not_depend_on_its_batch():
    alone, _ = rejection.draw_uniforms([torch.Generator().manual_seed(9)], [2], "cpu")
    batch = [torch.Generator().manual_seed(s) for s in (1, 9, 4)]
    together, resample = rejection.draw_uniforms(batch, [7, 2, 0], "cpu")
    assert torch.equal(together[1, :2], alone[0]) and together.shape == (3, 7)
    assert torch.equal(resample[1:2], torch.rand(3, generator=torch.Generator().manual_seed(9))[2:])


def test_propose_draws_greedy_plain_and_penalized_drafts():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(7))
    tokens, q = rejection.propose(logits, SamplingParams(), None, prompt_ids=[1], output_ids=[2])
    assert torch.equal(tokens, logits.argmax(dim=-1)) and q is None
    plain = SamplingParams(temperature=0.9, top_k=5)
    tokens, q = rejection.propose(logits, plain, torch.Generator().manual_seed(1), prompt_ids=[1], output_ids=[2])
    assert torch.equal(q, probabilities(logits, plain)) and (q.gather(1, tokens[:, None]) > 0).all()
    penalized = SamplingParams(temperature=0.9, frequency_penalty=1.5, repetition_penalty=1.3)
    tokens, q = rejection.propose(
        logits, penalized, torch.Generator().manual_seed(1), prompt_ids=[1], output_ids=[2, 2]
    )
    # row j must be the distribution the verify's row j samples from, given the drafts before it
    history = adjust_logits(logits, penalized, prompt_ids=[1], output_ids=[2, 2], drafted=tokens.tolist())
    assert torch.allclose(q, probabilities(history, penalized))
    with pytest.raises(ValueError, match="needs a generator"):
        rejection.propose(logits, plain, None, prompt_ids=[], output_ids=[])
