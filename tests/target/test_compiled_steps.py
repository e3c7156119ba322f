"""Static-shape (compiled) steps equal the eager forward: logits, routing, taps, caches, greedy tokens.

The oracle is the eager `Qwen3MoeModel.forward` / `DFlashDrafter.draft_logits` (itself checked
against transformers and the reference dflash package). Padding and bucket properties run the
step functions uncompiled (the same math, no compile cost); the compiled tests keep to two or
three buckets, so each compiles in well under a minute on the 2-core CPU.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET
from pdflash.sampling import SamplingParams
from pdflash.spec.draft_steps import DraftSteps
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.spec.step_install import install_steps
from pdflash.target.compiled import StepBuckets, TargetSteps, bucket_of, transposed
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target

PROMPTS = [list(range(10, 47)), list(range(200, 271)), list(range(900, 913))]  # ragged: 37, 71, 13 tokens


@pytest.fixture(scope="module")
def bundled():
    loaded = load_target(BUNDLED_TARGET)
    return loaded, load_drafter(BUNDLED_DRAFTER, loaded.model)


def _prefilled(model, prompts):
    caches = [model.new_cache() for _ in prompts]
    model.forward([torch.tensor(p) for p in prompts], caches, last_logits_only=True)
    return caches


def _forward_both(model, steps, blocks, caches, **kwargs):
    eager_caches = copy.deepcopy(caches)
    model.steps = None
    eager = model.forward(blocks, eager_caches, **kwargs)
    model.steps = steps
    try:
        stepped = model.forward(blocks, caches, **kwargs)
    finally:
        model.steps = None
    return eager, eager_caches, stepped


def test_bucket_of_picks_the_smallest_holding_bucket_and_none_above():
    assert [bucket_of(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert StepBuckets().upto(12).batch == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="ascending positive ints"):
        StepBuckets(batch=(4, 2))


def test_ragged_verify_through_padded_steps_equals_eager(bundled):
    """Three sequences of different lengths, blocks of 8, 3 and 5 tokens, padded to a batch of 4 x 8."""
    model = bundled[0].model
    steps = TargetSteps(model, StepBuckets(batch=(4,), tokens=(8,)), compiled=False)
    caches = _prefilled(model, PROMPTS)
    blocks = [torch.arange(5, 13), torch.tensor([7, 8, 9]), torch.arange(40, 45)]
    eager, eager_caches, stepped = _forward_both(model, steps, blocks, caches, taps=(0, 2, 3), commit=True)
    assert stepped.seq_lens == eager.seq_lens == (8, 3, 5)
    torch.testing.assert_close(stepped.logits, eager.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stepped.taps, eager.taps, atol=1e-4, rtol=1e-4)
    assert torch.equal(stepped.routed, eager.routed)
    for ours, theirs in zip(caches, eager_caches):
        assert ours.length == theirs.length
        torch.testing.assert_close(
            ours.keys[:, :, : ours.length], theirs.keys[:, :, : theirs.length], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            ours.values[:, :, : ours.length], theirs.values[:, :, : ours.length], atol=1e-5, rtol=0
        )
    assert not steps.fallbacks


def test_padding_and_stale_cache_rows_never_leak(bundled):
    """A sequence's outputs are the same alone (bucket 1) and beside others in a padded bucket,
    even when every cache row past its length holds large garbage (KVCache keeps such rows
    finite: zero-filled when grown, stale real K/V after a crop)."""
    model = bundled[0].model
    alone = _prefilled(model, PROMPTS[:1])
    crowd = _prefilled(model, PROMPTS)
    for cache in alone + crowd:
        cache.reserve(256)
        cache.keys[:, :, cache.length :] = 1e4
        cache.values[:, :, cache.length :] = -1e4
    block = torch.arange(5, 9)
    model.steps = TargetSteps(model, StepBuckets(batch=(1, 4), tokens=(8,)), compiled=False)
    try:
        single = model.forward([block], alone, commit=False)
        batched = model.forward([block, torch.tensor([3]), torch.arange(20, 28)], crowd, commit=False)
    finally:
        model.steps = None
    assert torch.isfinite(batched.logits).all()
    torch.testing.assert_close(batched.logits[:4], single.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(batched.routed[:4], single.routed)


def test_shape_outside_every_bucket_falls_back_to_eager_with_a_logged_reason(bundled, caplog):
    model = bundled[0].model
    steps = TargetSteps(model, StepBuckets(batch=(1, 2), tokens=(1,)), compiled=False)
    caches = _prefilled(model, PROMPTS)
    blocks = [torch.tensor([5]), torch.tensor([6]), torch.tensor([7])]  # 3 sequences > batch bucket 2
    with caplog.at_level(logging.INFO, logger="pdflash.target.compiled"):
        eager, _, stepped = _forward_both(model, steps, blocks, caches, last_logits_only=True)
    assert torch.equal(stepped.logits, eager.logits)  # the same eager code ran
    assert steps.fallbacks == {"more sequences than the largest batch bucket (2)": 1}
    assert "eager forward: more sequences than the largest batch bucket (2)" in caplog.text


def test_draft_steps_padded_and_ragged_equal_the_eager_drafter(bundled):
    loaded, drafter = bundled
    model = loaded.model
    taps = drafter.config.tap_layers
    caches = [model.new_cache() for _ in PROMPTS]
    out = model.forward([torch.tensor(p) for p in PROMPTS], caches, last_logits_only=True, taps=taps)
    draft_caches = [drafter.new_cache() for _ in PROMPTS]
    drafter.draft_logits(out.split_taps(), [torch.tensor([1, 3])] * 3, draft_caches)  # the prompt-long first round
    contexts = [torch.randn(c, len(taps) * model.config.hidden_size) for c in (3, 8, 1)]
    blocks = [torch.tensor([9, 3, 3, 3, 3, 3, 3, 3]), torch.tensor([4, 3, 3]), torch.tensor([11, 3, 3, 3, 3])]
    eager_caches = copy.deepcopy(draft_caches)
    expected = drafter.draft_logits(contexts, blocks, eager_caches)
    drafter.steps = DraftSteps(drafter, StepBuckets(batch=(4,), tokens=(8,)), compiled=False)
    try:
        got = drafter.draft_logits(contexts, blocks, draft_caches)
    finally:
        drafter.steps = None
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(draft_caches, eager_caches):
        assert ours.length == theirs.length
        torch.testing.assert_close(ours.keys[:, :, : ours.length], theirs.keys[:, :, : ours.length], atol=1e-5, rtol=0)


def test_compiled_ar_greedy_equals_eager_token_for_token(bundled):
    model = bundled[0].model
    params = SamplingParams(max_tokens=24)
    expected = generate_autoregressive(model, PROMPTS[0], params).token_ids
    caches = _prefilled(model, PROMPTS[:2])
    block = [torch.tensor([5]), torch.tensor([9])]
    model.steps = TargetSteps(model, StepBuckets(batch=(1, 2), tokens=(1,)), compiled=True)
    try:
        got = generate_autoregressive(model, PROMPTS[0], params).token_ids
        eager, _, stepped = _forward_both(model, model.steps, block, caches, last_logits_only=True)
    finally:
        model.steps = None
    assert got == expected
    torch.testing.assert_close(stepped.logits, eager.logits, atol=1e-4, rtol=1e-4)  # fp32 tolerance, batched


def test_compiled_dflash_batched_ragged_offloaded_at_a_tenth_equals_eager(bundled, offloaded):
    """Greedy DFlash rounds for three ragged sessions in one batch, experts offloaded to a 10% cache."""
    loaded = offloaded(BUNDLED_TARGET, expert_cache_fraction=0.1)
    drafter = load_drafter(BUNDLED_DRAFTER, loaded.model)
    speculator = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    params = SamplingParams(max_tokens=12)

    def run() -> list[list[int]]:
        sessions = speculator.begin_sessions([(p, params) for p in PROMPTS])
        while not all(s.finished for s in sessions):
            live = [s for s in sessions if not s.finished]
            speculator.draft_rounds(live)
            speculator.verify_rounds(live)
        return [list(s.emitted) for s in sessions]

    expected = run()
    one_bucket = StepBuckets(batch=(4,), tokens=(8,))  # every round pads to 4 sessions x 8 tokens: one compile each
    loaded.model.steps = TargetSteps(loaded.model, one_bucket, compiled=True)
    drafter.steps = DraftSteps(drafter, one_bucket, compiled=True)
    try:
        got = run()
        single = speculative_generate(speculator, PROMPTS[1], params).token_ids
    finally:
        loaded.model.steps = drafter.steps = None
    assert got == expected
    assert list(single) == expected[1]
    assert all(len(tokens) == 12 for tokens in got)


def test_install_steps_buckets_follow_the_drafter_and_the_seats(bundled):
    loaded, drafter = bundled
    speculator = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    try:
        seconds = install_steps(speculator, max_batch=3, compiled=False)
        assert loaded.model.steps is not None and drafter.steps is not None
        assert loaded.model.steps.buckets == StepBuckets(batch=(1, 2, 4), tokens=(1, 8))
        assert drafter.steps.buckets == StepBuckets(batch=(1, 2, 4), tokens=(8,))
        assert set(seconds) == {"target", "drafter"}
        # the bundled drafter shares the target's head: one transposed copy serves both steps
        assert drafter.lm_head.data_ptr() == loaded.model.lm_head.data_ptr()
        assert drafter.steps._lm_head_t is loaded.model.steps.lm_head_t
    finally:
        loaded.model.steps = drafter.steps = None


def test_transposed_weights_are_contiguous_copies_on_the_cpu():
    weight = torch.randn(6, 4)  # [out, in]
    weight_t = transposed(weight)
    assert weight_t.shape == (4, 6) and weight_t.is_contiguous()
    assert weight_t.data_ptr() != weight.data_ptr()
    assert torch.equal(weight_t, weight.t())
