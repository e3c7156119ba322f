"""SamplingParams validation and the sampling distribution."""

import pytest
import torch

from pdflash.sampling import SamplingParams, adjust_logits, probabilities, sample, token_logprobs
from pdflash.stopping import StopRule


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, r"^temperature=-1 is invalid: it must be a finite number >= 0$"),
        ({"temperature": float("nan")}, r"^temperature=nan is invalid: it must be a finite number >= 0$"),
        ({"top_p": 0}, r"^top_p=0 is invalid: it must be a finite number > 0 and <= 1$"),
        ({"top_p": 1.5}, r"^top_p=1.5 is invalid: it must be a finite number > 0 and <= 1$"),
        ({"top_k": -2}, r"^top_k=-2 is invalid: it must be an int >= 0 \(0 disables it\)$"),
        ({"top_k": 2.5}, r"^top_k=2.5 is invalid: it must be an int >= 0"),
        ({"max_tokens": 0}, r"^max_tokens=0 is invalid: it must be an int >= 1$"),
        ({"stop_token_ids": [-1]}, r"^stop_token_ids=\[-1\] is invalid: it must be non-negative integers$"),
        ({"stop": [""]}, r"^stop=\[''\] is invalid: it must be non-empty strings$"),
        (
            {"seed": "x"},
            r"^seed='x' is invalid: it must be an int in \[-9223372036854775808, 9223372036854775807\] or None$",
        ),
        ({"seed": 2**64}, r"^seed=18446744073709551616 is invalid: it must be an int in \[-9223372036854775808, "),
        ({"presence_penalty": 2.5}, r"^presence_penalty=2.5 is invalid: it must be a finite number >= -2 and <= 2$"),
        ({"frequency_penalty": "x"}, r"^frequency_penalty='x' is invalid: it must be a finite number >= -2 and <= 2$"),
        (
            {"repetition_penalty": 0},
            r"^repetition_penalty=0 is invalid: it must be a finite number > 0 \(1 disables it\)$",
        ),
        ({"min_p": 1.5}, r"^min_p=1.5 is invalid: it must be a finite number >= 0 and <= 1$"),
        ({"min_tokens": 65}, r"^min_tokens=65 is invalid: it must be an int in \[0, 64\] \(max_tokens=64\)$"),
        ({"ignore_eos": 1}, r"^ignore_eos=1 is invalid: it must be a boolean$"),
        ({"logprobs": 21}, r"^logprobs=21 is invalid: it must be an int in \[0, 20\] or None$"),
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


def test_adjust_logits_rows_follow_the_drafts_before_them():
    """Row r of a verify block is penalized as if drafted[:r] were already output (closed form per row)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5, max_tokens=8)
    prompt, output, drafted = [1, 2], [3, 3], [4, 3, 9]
    got = adjust_logits(logits, params, prompt_ids=prompt, output_ids=output, drafted=drafted)
    for r in range(4):
        history = output + drafted[:r]
        row = logits[r].tolist()
        for t in range(10):
            if t in prompt or t in history:
                row[t] = row[t] / 1.5 if row[t] > 0 else row[t] * 1.5
            count = history.count(t)
            row[t] -= 0.5 * count + (0.25 if count else 0)
        assert got[r].tolist() == pytest.approx(row, abs=1e-6)
    assert adjust_logits(logits, SamplingParams(), prompt_ids=prompt, output_ids=output) is logits


def test_min_tokens_masks_stop_tokens_only_in_early_rows():
    logits = torch.zeros(3, 6)
    params = SamplingParams(min_tokens=3, max_tokens=8)
    got = adjust_logits(logits, params, prompt_ids=[0], output_ids=[1], drafted=[2, 2], stop_ids={5})
    # rows continue 1, 2 and 3 output tokens: the first two are below min_tokens
    assert got[:, 5].tolist() == [float("-inf"), float("-inf"), 0.0] and (got[:, :5] == 0).all()


def test_min_p_drops_tokens_below_its_share_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.1
    assert p[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_token_logprobs_are_the_raw_log_softmax_and_its_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    items = token_logprobs(logits, [1, 2], top=2)
    reference = torch.log_softmax(logits, dim=-1)
    assert [lp.logprob for lp in items] == pytest.approx([reference[0, 1].item(), reference[1, 2].item()])
    assert [t for t, _ in items[0].top] == [0, 1] and [t for t, _ in items[1].top][0] == 2


def test_ignore_eos_drops_only_the_models_eos_from_the_stop_rule():
    params = SamplingParams(ignore_eos=True, stop_token_ids=[7])
    assert StopRule.for_request(3, params, 100, eos_ids=(2,)).stop_ids == {7}
    assert StopRule.for_request(3, SamplingParams(), 100, eos_ids=(2,)).stop_ids == {2}
