"""Speculative sampling keeps the target's distribution (chi-square over many seeds, tiny vocabulary)."""

import pytest
import torch

from pdflash.sampling import SamplingParams, probabilities
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target

VOCAB = 12
PROMPT = [3, 7, 1, 9]
SEEDS = 3000


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.999 (z = 3.09), Wilson–Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


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
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the top-k support was emitted"
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    critical = chi2_critical(dof)
    assert chi2 < critical, f"chi2={chi2:.1f} with {dof} dof exceeds {critical} (p=0.001)"
