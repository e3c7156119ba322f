"""The drafter equals the reference `dflash` package (test-only oracle) on the same checkpoints."""

import json
import time

import pytest
import torch
from hf_fixtures import write_hf_checkpoint

from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

dflash_model = pytest.importorskip(
    "dflash.model", reason="install the test oracle: pip install --no-deps dflash==0.1.0"
)
dflash_model._cuda_time = time.perf_counter

PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 2, 77, 14, 29]
DRAFTERS = {
    "full": dict(num_layers=2, block_size=8),
    "sliding": dict(
        num_layers=2,
        block_size=4,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=6,
    ),
    "sliding_unbounded": dict(
        num_layers=2, block_size=8, layer_types=["full_attention", "sliding_attention"], sliding_window=6
    ),
    "one_layer": dict(num_layers=1, block_size=16),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("target"), "gqa4_untied_nonorm")


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


# The reference's generate loop fails inside transformers' DynamicCache for a sliding layer without a
# window, so that layout is compared on drafter logits only.
GENERATES = sorted(set(DRAFTERS) - {"sliding_unbounded"})


@pytest.fixture(scope="module")
def pair(request, target_dir, hf_target, tmp_path_factory):
    drafter_dir = write_tiny_drafter(
        tmp_path_factory.mktemp(request.param), target_dir, std=0.2, **DRAFTERS[request.param]
    )
    reference = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    loaded = load_target(target_dir)
    return loaded, load_drafter(drafter_dir, loaded.model), reference


@pytest.mark.parametrize("pair", sorted(DRAFTERS), indirect=True)
def test_drafter_logits_match_reference(pair, hf_target):
    loaded, drafter, reference = pair
    with torch.no_grad():
        hidden = hf_target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        ctx = dflash_model.extract_context_feature(hidden, reference.target_layer_ids)  # [1, P, taps*H]
        block_size = drafter.config.block_size
        block = torch.tensor([[PROMPT[-1]] + [drafter.config.mask_token_id] * (block_size - 1)])
        noise = hf_target.get_input_embeddings()(block)
        positions = torch.arange(len(PROMPT) + block_size)[None]
        hidden_out = reference(target_hidden=ctx, noise_embedding=noise, position_ids=positions)
        expected = reference.compute_logits(hidden_out[:, 1:], hf_target.lm_head)[0]  # [B-1, V]
    got = drafter.draft_logits([ctx[0]], [block[0]], [drafter.new_cache()])[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pair", GENERATES, indirect=True)
def test_greedy_tokens_and_acceptance_match_reference(pair, hf_target):
    loaded, drafter, reference = pair
    with torch.no_grad():
        stats = dflash_model.dflash_generate(
            reference, hf_target, torch.tensor([PROMPT]), max_new_tokens=48, stop_token_ids=None, return_stats=True
        )
    expected_tokens = stats.output_ids[0, len(PROMPT) :].tolist()
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    result = speculative_generate(spec, PROMPT, SamplingParams(max_tokens=48))
    assert list(result.token_ids) == expected_tokens
    assert list(result.acceptance_lengths) == stats.acceptance_lengths


def test_published_config_without_tap_ids_uses_default_taps(target_dir, tmp_path):
    drafter_dir = write_tiny_drafter(tmp_path / "d", target_dir, num_layers=2)
    config = json.loads((drafter_dir / "config.json").read_text())
    assert "target_layer_ids" not in config["dflash_config"]
    reference = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    assert list(load_drafter(drafter_dir, load_target(target_dir).model).config.tap_layers) == list(
        reference.target_layer_ids
    )
