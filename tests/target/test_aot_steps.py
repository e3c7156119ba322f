"""AOTInductor steps: equal to eager, packaged once per shape and loaded from disk, keyed, and
falling back to torch.compile with a logged reason when a package cannot be had.

The oracle is the eager `Qwen3MoeModel.forward`. One package of the bundled target is built
(about half a minute on the 2-core CPU); the key and fallback tests use a two-line step and
never compile.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from pdflash.bundled import BUNDLED_TARGET
from pdflash.target import aot
from pdflash.target.aot import AotStep
from pdflash.target.compiled import BACKEND_ENV, StepBuckets, TargetSteps, step_backend
from pdflash.target.loader import load_target


def _scaled(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor, *, scale: float) -> torch.Tensor:
    """A step of two inputs (past's dim 1 a key length) and one constant."""
    return (x @ weight) * scale + past.sum(1)


def _tiny_step(fallback=None, scale: float = 2.0) -> AotStep:
    return AotStep(
        _scaled, (torch.ones(3, 3),), options={"scale": scale}, key_dims={1: 1}, min_keys=4, fallback=fallback
    )


def test_aot_whole_step_equals_eager_and_is_loaded_from_disk_the_second_time(tmp_path, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot")
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))  # empty: the first build is this test's
    model = load_target(BUNDLED_TARGET).model
    caches = [model.new_cache()]
    model.forward([torch.arange(70) + 3], caches)  # a 70-token past: the step pads it to 128 keys
    block = [torch.tensor([11])]
    eager_caches = copy.deepcopy(caches)
    eager = model.forward(block, eager_caches, last_logits_only=True, commit=False)
    outputs, built_s = [], []
    for _ in range(2):  # the first TargetSteps builds the package, the second loads it
        model.steps = TargetSteps(model, StepBuckets(batch=(1,), tokens=(1,)), compiled=True)
        try:
            scratch = copy.deepcopy(caches)
            out = model.forward(block, scratch, last_logits_only=True, commit=False)
            kept = out.logits.clone()
            model.forward([torch.tensor([12])], copy.deepcopy(caches), commit=False)
            assert torch.equal(out.logits, kept)  # a later run leaves earlier outputs alone
            outputs.append((out, scratch))
        finally:
            steps, model.steps = model.steps, None
        assert isinstance(steps._step, AotStep)
        built_s.append(steps._step.built_s)
    (first, first_caches), (second, second_caches) = outputs
    assert built_s[0] > 0.0 and built_s[1] == 0.0  # the second one built nothing
    assert len(list(tmp_path.glob("whole_step-*.pt2"))) == 1
    torch.testing.assert_close(first.logits, eager.logits, atol=1e-4, rtol=1e-4)  # fp32 tolerance
    assert torch.equal(first.routed, eager.routed)
    assert first.logits.argmax(-1).tolist() == eager.logits.argmax(-1).tolist()
    torch.testing.assert_close(first_caches[0].keys[:, :, :71], eager_caches[0].keys[:, :, :71])
    assert torch.equal(second.logits, first.logits) and torch.equal(second_caches[0].keys, first_caches[0].keys)


def test_package_key_follows_shapes_threads_and_options_not_the_key_length(aot_cache):
    step = _tiny_step()
    x, weight = torch.ones(2, 3), torch.ones(3, 3)
    assert step.package_path((x, torch.ones(2, 64, 3))) == step.package_path((x, torch.ones(2, 128, 3)))
    assert step.package_path((x, torch.ones(2, 64, 3))) != step.package_path((torch.ones(4, 3), torch.ones(4, 64, 3)))
    assert step.package_path((x, torch.ones(2, 64, 3))) != _tiny_step(scale=3.0).package_path((x, torch.ones(2, 64, 3)))
    threads = torch.get_num_threads()
    one = step.package_path((x, torch.ones(2, 64, 3)))
    torch.set_num_threads(threads + 1)
    try:
        assert step.package_path((x, torch.ones(2, 64, 3))) != one  # kernels are built for a thread count
    finally:
        torch.set_num_threads(threads)
    assert one.parent == aot_cache and torch.equal(_scaled(x, torch.ones(2, 4, 3), weight, scale=2.0), 2 * 3 + 4 * x)


def test_a_package_that_cannot_be_built_or_loaded_falls_back_with_a_logged_reason(aot_cache, monkeypatch, caplog):
    calls = []

    def fallback(*inputs):
        calls.append(len(inputs))
        return _scaled(*inputs, torch.ones(3, 3), scale=2.0)

    def refuse(*args, **kwargs):
        raise RuntimeError("export refused for this test")

    monkeypatch.setattr(torch.export, "export", refuse)
    x, past = torch.randn(2, 3), torch.randn(2, 8, 3)
    with caplog.at_level(logging.WARNING, logger=aot.__name__):
        step = _tiny_step(fallback)
        assert torch.equal(step(x, past), _scaled(x, past, torch.ones(3, 3), scale=2.0))
        step(x, past)  # the same shape: its runner is the fallback, no second attempt or message
    assert calls == [2, 2]
    (record,) = [r for r in caplog.records if r.name == aot.__name__]
    assert "export refused for this test" in record.getMessage() and "using torch.compile" in record.getMessage()

    step.package_path((x, past)).write_bytes(b"not a package")  # a corrupt file on disk
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=aot.__name__):
        assert torch.equal(_tiny_step(fallback)(x, past), _scaled(x, past, torch.ones(3, 3), scale=2.0))
    (record,) = [r for r in caplog.records if r.name == aot.__name__]
    assert "unavailable" in record.getMessage() and "using torch.compile" in record.getMessage()


def test_step_backend_is_aot_on_the_cpu_and_rejects_an_unknown_name(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert step_backend(torch.device("cpu")) == "aot"
    assert step_backend(torch.device("cuda")) == "inductor"  # CUDA graphs come from torch.compile
    monkeypatch.setenv(BACKEND_ENV, "tensorrt")
    with pytest.raises(ValueError, match="'aot' or 'inductor', got 'tensorrt'"):
        step_backend(torch.device("cpu"))
