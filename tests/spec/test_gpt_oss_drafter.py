"""DFlash drafters on gpt-oss targets equal the reference `dflash` package over transformers' gpt-oss.

The drafters use the published layout for gpt-oss (sliding-window and full layers, explicit
tap layers, blocks of 8 and 10); the target is a tiny MXFP4 checkpoint that transformers
dequantizes itself.
"""

import time

import pytest
import torch
from hf_gpt_oss import load_hf_gpt_oss, write_hf_gpt_oss

from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.spec.train import DrafterTrainer, TrainSettings, build_training_data
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

dflash_model = pytest.importorskip(
    "dflash.model", reason="install the test oracle: pip install --no-deps dflash==0.1.0"
)
dflash_model._cuda_time = time.perf_counter

PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 2, 77, 14, 29]
MASK_ID = 95  # the tiny vocabulary's last id
DRAFTERS = {  # as z-lab's gpt-oss-20b (block 8) and gpt-oss-120b (block 10) drafters, scaled down
    "block8": dict(
        num_layers=2,
        block_size=8,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=6,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]},
    ),
    "block10": dict(
        num_layers=3,
        block_size=10,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=12,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 2]},
    ),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), "sinks_sliding_yarn", "mxfp4")


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return load_hf_gpt_oss(target_dir)


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def pair(request, target_dir, tmp_path_factory):
    drafter_dir = write_tiny_drafter(
        tmp_path_factory.mktemp(request.param), target_dir, std=0.2, **DRAFTERS[request.param]
    )
    reference = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    loaded = load_target(target_dir)
    return loaded, load_drafter(drafter_dir, loaded.model), reference


def test_published_layout_loads_unchanged(pair):
    _, drafter, reference = pair
    assert list(drafter.config.tap_layers) == list(reference.target_layer_ids)
    assert drafter.config.block_size == reference.block_size
    assert any(w is not None for w in drafter.config.sliding_window)


def test_greedy_tokens_and_acceptance_match_reference(pair, hf_target):
    loaded, drafter, reference = pair
    with torch.no_grad():
        stats = dflash_model.dflash_generate(
            reference, hf_target, torch.tensor([PROMPT]), max_new_tokens=48, stop_token_ids=None, return_stats=True
        )
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    result = speculative_generate(spec, PROMPT, SamplingParams(max_tokens=48))
    assert list(result.token_ids) == stats.output_ids[0, len(PROMPT) :].tolist()
    assert list(result.acceptance_lengths) == stats.acceptance_lengths


def test_greedy_speculative_equals_plain_decoding(pair):
    loaded, drafter, _ = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    greedy = SamplingParams(max_tokens=40)
    assert speculative_generate(spec, PROMPT, greedy).token_ids == (
        generate_autoregressive(loaded.model, PROMPT, greedy).token_ids
    )


@pytest.fixture(scope="module")
def trained_dir(target_dir, tmp_path_factory):
    """`pdflash train-drafter`'s trainer on the gpt-oss target (its own greedy continuations)."""
    target = load_target(target_dir)
    trainer = DrafterTrainer(
        target, TrainSettings(num_layers=2, block_size=8, steps=120, batch_sequences=8, lr=3e-3, warmup_steps=10)
    )
    prompts = torch.randint(0, 96, (24, 12), generator=torch.Generator().manual_seed(0)).tolist()
    data = build_training_data(target, prompts, response_tokens=40, tap_layers=trainer.config.tap_layers)
    result = trainer.train(data)
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < first, f"loss {first:.3f} -> {last:.3f}"
    return trainer.save(tmp_path_factory.mktemp("trained"), dtype=torch.float32)


def test_trained_drafter_matches_reference_with_accepted_drafts(target_dir, trained_dir, hf_target):
    loaded = load_target(target_dir)
    reference = dflash_model.DFlashDraftModel.from_pretrained(trained_dir, dtype=torch.float32).eval()
    prompt = [7, 70, 23, 4, 56, 81, 12, 9, 44, 30, 2, 65]
    with torch.no_grad():
        stats = dflash_model.dflash_generate(
            reference, hf_target, torch.tensor([prompt]), max_new_tokens=48, stop_token_ids=None, return_stats=True
        )
    spec = Speculator(loaded.model, load_drafter(trained_dir, loaded.model), expert_nbytes=loaded.expert_nbytes)
    ours = speculative_generate(spec, prompt, SamplingParams(max_tokens=48))
    assert list(ours.token_ids) == stats.output_ids[0, len(prompt) :].tolist()
    assert list(ours.acceptance_lengths) == stats.acceptance_lengths
    assert max(ours.acceptance_lengths) > 1  # drafts were accepted: the comparison covers multi-token commits
