"""Fixtures of the CUDA tests: the device they run on and the models loaded there.

Every test here is marked `cuda` and skips without a GPU (the hook below). Run them in a
session of their own with `TRITON_INTERPRET` unset or 0, as tools/gpu_check.sh does: triton
decides between compiling and interpreting a kernel once, when its module is imported, and the
CPU tests import the kernels interpreted. `PDFLASH_TEST_DEVICE=cpu` runs the device-generic
tests on the CPU (to check the tests themselves); the ones about CUDA-only mechanisms skip.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch

from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET
from pdflash.spec.drafter import DFlashDrafter, load_drafter
from pdflash.target.loader import LoadedTarget, load_target

TEST_DEVICE = os.environ.get("PDFLASH_TEST_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests skip where torch sees no CUDA device."""
    if TEST_DEVICE != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(TEST_DEVICE)


@pytest.fixture
def cuda_only(device) -> None:
    if device.type != "cuda":
        pytest.skip("checks a CUDA-only mechanism (streams, events, pinned memory, compiled kernels)")


@attrs.frozen
class Pair:
    loaded: LoadedTarget
    drafter: DFlashDrafter


@pytest.fixture(scope="session")
def bundled_fp32(device) -> Pair:
    """The bundled trained pair on the device in float32: greedy equality holds there (in half
    precision the verify's batched matmuls round differently from one token's, so it may not)."""
    loaded = load_target(BUNDLED_TARGET, dtype="float32", device=device)
    return Pair(loaded, load_drafter(BUNDLED_DRAFTER, loaded.model))


@pytest.fixture(scope="session")
def code_prompts(bundled_fp32) -> list[list[int]]:
    tokenizer = bundled_fp32.loaded.tokenizer
    texts = [
        "def fib(n):\n    if n < 2:\n        return n",
        "import os\n\ndef list_files(path):\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
        "# sort a list of numbers\ndef sort(xs):",
    ]
    return [tokenizer.encode(t) for t in texts]
