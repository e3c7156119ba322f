"""Greedy DFlash on CUDA is plain decoding, token for token: alone and batched (bundled pair, fp32)."""

import pytest

from pdflash.sampling import SamplingParams
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.target.generate import generate_autoregressive

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def plain(bundled_fp32, code_prompts):
    """Greedy autoregressive tokens of each prompt alone on the device: the oracle."""
    model = bundled_fp32.loaded.model
    return [generate_autoregressive(model, p, GREEDY).token_ids for p in code_prompts]


def speculator(pair) -> Speculator:
    return Speculator(pair.loaded.model, pair.drafter, expert_nbytes=pair.loaded.expert_nbytes)


def test_greedy_dflash_on_the_device_equals_plain_decoding(bundled_fp32, code_prompts, plain, device):
    spec = speculator(bundled_fp32)
    assert spec.target.device.type == device.type and spec.drafter.fc.device.type == device.type
    accepted = []
    for prompt, want in zip(code_prompts, plain):
        got = speculative_generate(spec, prompt, GREEDY)
        assert got.token_ids == want
        accepted += got.acceptance_lengths
    assert max(accepted) > 1, "the trained drafter is accepted at least once"


def test_batched_rounds_on_the_device_equal_each_prompt_alone(bundled_fp32, code_prompts, plain):
    spec = speculator(bundled_fp32)
    sessions = spec.begin_sessions([(p, GREEDY) for p in code_prompts])
    while live := [s for s in sessions if not s.finished]:
        spec.draft_rounds(live)
        spec.verify_rounds(live)
    assert [tuple(s.emitted) for s in sessions] == plain
    for s in sessions:
        spec.release(s)
