"""`pdflash train-drafter`: training lowers the loss and raises τ; checkpoints load in the reference."""

import time

import pytest
import torch
from hf_fixtures import write_hf_checkpoint

from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.spec.train import DrafterTrainer, TrainSettings, build_training_data
from pdflash.target.loader import load_target


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def mean_tau(target, drafter, prompts) -> float:
    spec = Speculator(target.model, drafter, expert_nbytes=target.expert_nbytes, projector="last-union")
    lengths = [
        a for p in prompts for a in speculative_generate(spec, p, SamplingParams(max_tokens=32)).acceptance_lengths
    ]
    return sum(lengths) / len(lengths)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    target = load_target(tiny_target)
    settings = TrainSettings(
        num_layers=1, block_size=4, steps=300, batch_sequences=8, anchors_per_sequence=6, lr=3e-3, warmup_steps=20
    )
    trainer = DrafterTrainer(target, settings)
    untrained_dir = trainer.save(tmp_path_factory.mktemp("untrained"), dtype=torch.float32)
    data = build_training_data(
        target, random_prompts(48, 16, 256), response_tokens=48, tap_layers=trainer.config.tap_layers
    )
    result = trainer.train(data)
    trained_dir = trainer.save(tmp_path_factory.mktemp("trained"), dtype=torch.float32)
    return target, untrained_dir, trained_dir, result


def test_training_lowers_loss_and_raises_acceptance(trained):
    target, untrained_dir, trained_dir, result = trained
    first, last = sum(result.losses[:20]) / 20, sum(result.losses[-20:]) / 20
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"
    prompts = random_prompts(4, 16, 256, seed=99)  # prompts not in the training data
    before = mean_tau(target, load_drafter(untrained_dir, target.model), prompts)
    after = mean_tau(target, load_drafter(trained_dir, target.model), prompts)
    assert after > before + 0.2, f"τ {before:.2f} -> {after:.2f}"  # measured: 1.00 -> 1.39


def test_minutes_limit_stops_training(tiny_target):
    target = load_target(tiny_target)
    trainer = DrafterTrainer(target, TrainSettings(steps=10_000, minutes=0.02, block_size=4))
    data = build_training_data(
        target, random_prompts(8, 12, 256), response_tokens=16, tap_layers=trainer.config.tap_layers
    )
    started = time.perf_counter()
    result = trainer.train(data)
    assert result.steps < 10_000 and time.perf_counter() - started < 30


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 1}, "block_size must be >= 2, got 1"),
        ({"steps": 0}, "steps must be >= 1, got 0"),
        ({"minutes": -1}, "minutes must be > 0, got -1"),
    ],
)
def test_invalid_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainSettings(**kwargs)


def test_trainer_checkpoint_gives_reference_drafts(tmp_path, monkeypatch):
    dflash_model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    from transformers import Qwen3MoeForCausalLM

    target_dir = write_hf_checkpoint(tmp_path / "target", "gqa4_untied_nonorm")
    target = load_target(target_dir)
    trainer = DrafterTrainer(target, TrainSettings(num_layers=2, block_size=8, steps=30, warmup_steps=5))
    data = build_training_data(
        target, random_prompts(8, 12, 96), response_tokens=24, tap_layers=trainer.config.tap_layers
    )
    trainer.train(data)
    drafter_dir = trainer.save(tmp_path / "drafter", dtype=torch.float32)
    reference = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    hf = Qwen3MoeForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, 12, 96, seed=5)
    with torch.no_grad():
        stats = dflash_model.dflash_generate(
            reference, hf, torch.tensor(prompt), max_new_tokens=32, stop_token_ids=None, return_stats=True
        )
    spec = Speculator(target.model, load_drafter(drafter_dir, target.model), expert_nbytes=target.expert_nbytes)
    ours = speculative_generate(spec, prompt[0], SamplingParams(max_tokens=32))
    assert list(ours.token_ids) == stats.output_ids[0, 12:].tolist()
    assert list(ours.acceptance_lengths) == stats.acceptance_lengths
