"""The gpt-oss target equals Hugging Face transformers on the same weights, MXFP4 and bf16 forms."""

import pytest
import torch
from hf_gpt_oss import FORMS, HF_GPT_OSS_CONFIGS, load_hf_gpt_oss, write_hf_gpt_oss

from pdflash.sampling import SamplingParams
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target

PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 2, 77, 14, 29]


@pytest.fixture(scope="module", params=[(c, f) for c in sorted(HF_GPT_OSS_CONFIGS) for f in FORMS], ids=str)
def pair(request, tmp_path_factory):
    name, form = request.param
    directory = write_hf_gpt_oss(tmp_path_factory.mktemp(f"{name}-{form}"), name, form)
    return load_target(directory), load_hf_gpt_oss(directory)


def test_prompt_logits_match_transformers(pair):
    loaded, hf_model = pair
    target = loaded.model
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]  # [n, V]
    got = target.forward([torch.tensor(PROMPT)], [target.new_cache()]).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_64_greedy_tokens_match_transformers(pair):
    loaded, hf_model = pair
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    got = generate_autoregressive(loaded.model, PROMPT, SamplingParams(max_tokens=64)).token_ids
    assert list(got) == expected


def test_batched_chunks_equal_one_sequence_at_a_time(pair):
    """Two sequences in one forward, each continued in a second chunk, equal their lone full-prompt logits."""
    target = pair[0].model
    prompts = [torch.tensor(PROMPT), torch.tensor(PROMPT[::-1] + PROMPT[:3])]
    alone = [target.forward([p], [target.new_cache()]).logits for p in prompts]
    caches = [target.new_cache(), target.new_cache()]
    first = target.forward([p[:7] for p in prompts], caches)
    second = target.forward([p[7:] for p in prompts], caches)
    for i, expected in enumerate(alone):
        got = torch.cat([first.split(first.logits)[i], second.split(second.logits)[i]])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_prefill_beside_a_verify_gets_its_last_logits_and_the_verify_all_of_its_own(pair):
    """One forward continuing one sequence by a block and prefilling another (last_logits_only per
    sequence): the block's rows and the prompt's last row equal the two forwards alone."""
    target = pair[0].model
    block, prompt = torch.tensor(PROMPT[7:]), torch.tensor(PROMPT[::-1])
    alone = target.new_cache()
    target.forward([torch.tensor(PROMPT[:7])], [alone])
    expected_block = target.forward([block], [alone]).logits
    expected_last = target.forward([prompt], [target.new_cache()], last_logits_only=True).logits
    cache = target.new_cache()
    target.forward([torch.tensor(PROMPT[:7])], [cache])
    out = target.forward([block, prompt], [cache, target.new_cache()], last_logits_only=[False, True])
    got_block, got_last = out.split_logits()
    torch.testing.assert_close(got_block, expected_block, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_last, expected_last, atol=1e-5, rtol=1e-5)
