"""SamplingParams validation and the sampling distribution."""

import pytest
import torch

from pdflash.sampling import SamplingParams, probabilities, sample
from pdflash.stopping import StopRule


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"seed": "x"}, "seed must be an integer or None"),
    ],
)
def test_invalid_params_raise_with_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0, 2:] == 0).all()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone already holds >= half the mass


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.8, seed=7)
    assert torch.equal(sample(logits, params, params.generator()), sample(logits, params, params.generator()))


def test_stop_rule_clips_after_stop_token_and_at_limit():
    rule = StopRule.for_request(4, SamplingParams(max_tokens=5, stop_token_ids=[9]), max_positions=100)
    assert rule.clip(0, [1, 9, 3]) == ([1, 9], "stop")
    assert rule.clip(3, [1, 2, 3]) == ([1, 2], "length")
    assert rule.clip(0, [1, 2]) == ([1, 2], None)
