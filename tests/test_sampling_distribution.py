"""Speculative sampling keeps the target's distribution end to end (chi-square over many seeded requests).

Each test runs many seeded requests through the Speculator's rounds (drafts drawn from the
drafter's q, rejection sampling against the target's p) and compares the tokens emitted at
an output position with that position's exact marginal under plain sampling of the target,
computed by target forwards over every prefix in the sampling support.
"""

import attrs
import pytest
import torch
from chi_square import chi_square

from pdflash.bundled import default_drafter, default_target
from pdflash.sampling import SamplingParams, probabilities
from pdflash.spec.acceptance import CONFIDENCE_EDGES, ConfidenceTable
from pdflash.spec.drafter import load_drafter
from pdflash.spec.policy import PolicyInputs, RoundCosts, VerifyCut
from pdflash.spec.speculator import Speculator
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target

VOCAB = 12
PROMPT = [3, 7, 1, 9]
SEEDS = 3000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir = write_tiny_target(
        tmp_path_factory.mktemp("t"), with_tokenizer=False, vocab_size=VOCAB, std=0.5, num_hidden_layers=2
    )
    loaded = load_target(target_dir)
    drafter_dir = write_tiny_drafter(
        tmp_path_factory.mktemp("d"), target_dir, num_layers=1, block_size=4, std=0.5, seed=3
    )
    return loaded, load_drafter(drafter_dir, loaded.model)


def second_token_distribution(model, params: SamplingParams) -> torch.Tensor:
    """Exact P(second generated token) = Σ_t1 p(t1 | prompt) p(t2 | prompt, t1)."""
    with torch.no_grad():
        first = probabilities(
            model.forward([torch.tensor(PROMPT)], [model.new_cache()], last_logits_only=True).logits, params
        )[0]
        seqs = [torch.tensor(PROMPT + [t]) for t in range(VOCAB)]
        second = model.forward(seqs, [model.new_cache() for _ in seqs], last_logits_only=True).logits
        return first @ probabilities(second, params)  # [V]


@pytest.mark.parametrize("top_k", [0, 3])
def test_second_token_follows_target_distribution(pair, top_k):
    loaded, drafter = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    requests = [(PROMPT, SamplingParams(temperature=1.0, top_k=top_k, max_tokens=2, seed=s)) for s in range(SEEDS)]
    sessions = spec.begin_sessions(requests)
    spec.draft_rounds(sessions)
    accepted = sum(r.accepted_drafts for r in spec.verify_rounds(sessions))
    assert accepted > 0, "the drafter's proposal was never accepted: the test would not exercise acceptance"
    counts = torch.bincount(torch.tensor([s.emitted[1] for s in sessions]), minlength=VOCAB).double()
    expected = second_token_distribution(loaded.model, requests[0][1]).double() * SEEDS
    fit = chi_square(counts, expected / SEEDS)
    assert fit.p_value > 1e-3, str(fit)


PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.4, "min_p": 0.02}


def penalized(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    """[V] logits with PENALTIES written out by hand (prompt + output repetition, output counts)."""
    row = logits.clone()
    for t in set(PROMPT) | set(output):
        row[t] = row[t] / PENALTIES["repetition_penalty"] if row[t] > 0 else row[t] * PENALTIES["repetition_penalty"]
    for t in set(output):
        row[t] -= PENALTIES["frequency_penalty"] * output.count(t) + PENALTIES["presence_penalty"]
    return row


def test_penalized_second_token_follows_the_penalized_target_distribution(pair):
    """Penalties act on each verify row's own history, so acceptance keeps the penalized distribution."""
    loaded, drafter = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    requests = [(PROMPT, SamplingParams(temperature=1.0, max_tokens=2, seed=s, **PENALTIES)) for s in range(SEEDS)]
    sessions = spec.begin_sessions(requests)
    spec.draft_rounds(sessions)
    assert sum(r.accepted_drafts for r in spec.verify_rounds(sessions)) > 0
    counts = torch.bincount(torch.tensor([s.emitted[1] for s in sessions]), minlength=VOCAB).double()
    plain = SamplingParams(temperature=1.0, min_p=PENALTIES["min_p"])  # penalties applied by hand below
    model = loaded.model
    with torch.no_grad():
        logits = model.forward([torch.tensor(PROMPT)], [model.new_cache()], last_logits_only=True).logits[0].float()
        first = probabilities(penalized(logits, [])[None], plain)[0]
        seqs = [torch.tensor(PROMPT + [t]) for t in range(VOCAB)]
        second = model.forward(seqs, [model.new_cache() for _ in seqs], last_logits_only=True).logits.float()
        rows = torch.stack([penalized(second[t], [t]) for t in range(VOCAB)])
        expected = (first @ probabilities(rows, plain)).double() * SEEDS
    fit = chi_square(counts, expected / SEEDS)
    assert fit.p_value > 1e-3, str(fit)


def output_marginals(model, prompt: list[int], params: SamplingParams, depth: int) -> list[torch.Tensor]:
    """[V] exact P(output token j = ·) for j < depth under plain sampling: Σ over every prefix in
    the support of P(prefix) · p(· | prompt + prefix), by batched target forwards."""
    prefixes, weights, marginals = [[]], torch.ones(1, dtype=torch.float64), []
    for j in range(depth):
        p = torch.cat(
            [next_token_probs(model, prompt, prefixes[i : i + 128], params) for i in range(0, len(prefixes), 128)]
        )
        marginals.append(weights @ p)  # [V]
        if j + 1 < depth:
            keep = (p > 0).nonzero().tolist()  # the support: (prefix, next token)
            prefixes = [prefixes[i] + [t] for i, t in keep]
            weights = torch.tensor([float(weights[i] * p[i, t]) for i, t in keep], dtype=torch.float64)
    return marginals


def next_token_probs(model, prompt: list[int], prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[len(prefixes), V] float64 p(· | prompt + prefix) under `params`."""
    caches = [model.new_cache() for _ in prefixes]
    with torch.no_grad():
        seqs = [torch.tensor(prompt + prefix) for prefix in prefixes]
        logits = model.forward(seqs, caches, last_logits_only=True).logits
    for cache in caches:
        cache.release()
    return probabilities(logits, params).double()


def sampled_outputs(
    spec: Speculator,
    prompt: list[int],
    params: SamplingParams,
    seeds: int,
    chunk: int = 250,
    cut: VerifyCut | None = None,
    verified: list[int] | None = None,
):
    """[seeds, max_tokens] tokens emitted by seeded requests 0 … seeds-1, and the drafts each first
    round kept. With `cut`, every round's drafts are cut by it; `verified` collects each round's length."""
    outputs, first_round = [], []
    for start in range(0, seeds, chunk):
        batch = [(prompt, attrs.evolve(params, seed=s)) for s in range(start, min(start + chunk, seeds))]
        sessions = spec.begin_sessions(batch)
        drafts = spec.draft_rounds(sessions, cuts=[cut] * len(sessions))
        first_round += [r.accepted_drafts for r in spec.verify_rounds(sessions)]
        while live := [s for s in sessions if not s.finished]:
            drafts += spec.draft_rounds(live, cuts=[cut] * len(live))
            spec.verify_rounds(live)
        if verified is not None:
            verified += [d.tokens for d in drafts]
        outputs += [s.emitted for s in sessions]
        for s in sessions:
            spec.release(s)
    return torch.tensor(outputs), torch.tensor(first_round)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_k=3, max_tokens=4), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4)],
    ids=["top-k", "top-p"],
)
def test_tokens_at_every_block_position_follow_the_target(pair, params):
    """Output tokens 1 … 3 come from the first round's block positions 0 … 2 (or a later round)."""
    loaded, drafter = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    outputs, first_round = sampled_outputs(spec, PROMPT, params, SEEDS)
    deep = torch.bincount(first_round, minlength=4)  # first rounds by drafts accepted
    assert deep[2:].sum() > 50, f"too few deep acceptances to exercise the later block positions: {deep.tolist()}"
    for j, marginal in enumerate(output_marginals(loaded.model, PROMPT, params, 4)):
        fit = chi_square(torch.bincount(outputs[:, j], minlength=VOCAB), marginal)
        assert fit.p_value > 1e-3, f"output token {j}: {fit}"


def stop_at_doubt(block: int, sure_above: float) -> VerifyCut:
    """A cut that verifies the drafts before the first one whose confidence is below `sure_above`
    (at least one draft): drafts at or above it are believed always accepted, those below never,
    and a verify costs the same whatever its length."""
    inputs = PolicyInputs(
        acceptance=(0.5,) * (block - 1),
        prefix_fetch_bytes=(0,) * block,
        costs=RoundCosts(round_s=1.0, block_s=(0.0,) * block, draft_s=0.0, link_bytes_per_s=None),
    )
    edge = CONFIDENCE_EDGES.index(sure_above)
    table = ConfidenceTable(tuple(0.0 if i <= edge else 1.0 for i in range(len(CONFIDENCE_EDGES) + 1)))
    return VerifyCut(inputs=inputs, table=table)


def test_a_verify_cut_by_the_peaks_of_q_keeps_the_target_distribution(pair):
    """Drafts are cut where the drafter doubts (pdflash.spec.policy.VerifyCut), read off the peak of
    each q, which does not depend on what was drawn from it: every output token keeps the target's
    marginal while the verify lengths vary from round to round."""
    loaded, drafter = pair
    params = SamplingParams(temperature=2.0, max_tokens=4)  # q's peaks 0.77-0.80 in the first round
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    verified: list[int] = []
    cut = stop_at_doubt(spec.block_size, 0.6)  # verifies 2, 3 and 4 tokens, each in 1/5 of the rounds or more
    outputs, _ = sampled_outputs(spec, PROMPT, params, SEEDS, cut=cut, verified=verified)
    lengths = torch.bincount(torch.tensor(verified), minlength=spec.block_size + 1)
    assert (lengths[2:] > 1000).all(), f"the cut did not vary the verify length enough: {lengths.tolist()}"
    for j, marginal in enumerate(output_marginals(loaded.model, PROMPT, params, 4)):
        fit = chi_square(torch.bincount(outputs[:, j], minlength=VOCAB), marginal)
        assert fit.p_value > 1e-3, f"output token {j}: {fit}"


BUNDLED_PROMPT = "def fib(n):"
BUNDLED_SEEDS = 2000


@pytest.fixture(scope="module")
def bundled():
    loaded = load_target(default_target())
    return loaded, load_drafter(default_drafter(default_target()), loaded.model)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_k=5, max_tokens=4), SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4)],
    ids=["top-k", "top-p"],
)
def test_bundled_pair_emits_the_targets_distribution(bundled, params):
    """The trained pair at the bundled model's temperature: the first four tokens after a fixed
    prompt have the target's own marginals; a shift to temperature 1 would be detected."""
    loaded, drafter = bundled
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union", block_size=4)
    prompt = loaded.tokenizer.encode(BUNDLED_PROMPT)
    outputs, first_round = sampled_outputs(spec, prompt, params, BUNDLED_SEEDS)
    deep = torch.bincount(first_round, minlength=4)  # first rounds by drafts accepted
    assert deep[2:].sum() > 100, f"too few deep acceptances to exercise the later block positions: {deep.tolist()}"
    vocab = loaded.model.config.vocab_size
    hotter = output_marginals(loaded.model, prompt, attrs.evolve(params, temperature=1.0), 1)
    for j, marginal in enumerate(output_marginals(loaded.model, prompt, params, 4)):
        counts = torch.bincount(outputs[:, j], minlength=vocab)
        fit = chi_square(counts, marginal)
        assert fit.p_value > 1e-3, f"output token {j}: {fit}"
        if j == 0:
            assert chi_square(counts, hotter[j]).p_value < 1e-6, "the test could not tell T=0.7 from T=1"
