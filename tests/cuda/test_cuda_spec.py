"""DFlash on CUDA: greedy is plain decoding token for token, alone and batched; seeded sampling reproduces (bundled pair, fp32)."""

import pytest
import torch

from pdflash.sampling import SamplingParams
from pdflash.spec import rejection
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


def test_seeded_sampled_dflash_on_the_device_reproduces_alone_and_batched(bundled_fp32, code_prompts):
    """Drafts, q and the rejection uniforms all come from each request's device generator."""
    spec = speculator(bundled_fp32)
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=32, seed=i) for i in range(len(code_prompts))]
    alone = [speculative_generate(spec, p, sp).token_ids for p, sp in zip(code_prompts, params)]
    sessions = spec.begin_sessions(list(zip(code_prompts, params)))
    while live := [s for s in sessions if not s.finished]:
        spec.draft_rounds(live)
        spec.verify_rounds(live)
    assert [tuple(s.emitted) for s in sessions] == alone
    for s in sessions:
        spec.release(s)


def test_rejection_on_the_device_decides_as_on_the_cpu(device):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 5, 300, generator=g), dim=-1)
    q = torch.softmax(torch.randn(64, 4, 300, generator=g), dim=-1)
    drafts = torch.stack([torch.multinomial(q[:, k], 1, generator=g).squeeze(1) for k in range(4)], 1)
    counts, test_u, resample_u = (
        torch.randint(0, 5, (64,), generator=g),
        torch.rand(64, 4, generator=g),
        torch.rand(64, generator=g),
    )
    cpu = rejection.accept(p, q, drafts, counts, test_u, resample_u)
    on_device = rejection.accept(*(t.to(device) for t in (p, q, drafts, counts, test_u, resample_u)))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, on_device))
