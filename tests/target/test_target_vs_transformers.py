"""The Qwen3-MoE target equals Hugging Face transformers on the same checkpoint."""

import pytest
import torch

from pdflash.sampling import SamplingParams
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target

PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 2, 77, 14, 29]


@pytest.fixture(scope="module")
def hf_model(hf_checkpoint):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32).eval()


def test_prompt_logits_match_transformers(hf_checkpoint, hf_model):
    target = load_target(hf_checkpoint).model
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]  # [n, V]
    got = target.forward([torch.tensor(PROMPT)], [target.new_cache()]).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_64_greedy_tokens_match_transformers(hf_checkpoint, hf_model):
    target = load_target(hf_checkpoint).model
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    got = generate_autoregressive(target, PROMPT, SamplingParams(max_tokens=64)).token_ids
    assert list(got) == expected


def test_tap_is_residual_stream_after_layer(hf_checkpoint, hf_model):
    target = load_target(hf_checkpoint).model
    taps = (0, target.config.num_layers - 1)
    with torch.no_grad():
        hidden = hf_model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    out = target.forward([torch.tensor(PROMPT)], [target.new_cache()], taps=taps)
    H = target.config.hidden_size
    torch.testing.assert_close(out.taps[:, :H], hidden[1][0], atol=1e-4, rtol=1e-4)
    # transformers applies the final norm to the last entry; ours is the raw residual after the last layer
    assert out.taps.shape == (len(PROMPT), 2 * H)
