import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PDFLASH_NO_COMPILE", "1")  # CLI runs stay eager: compiled steps have their own tests
# Triton reads this when a kernel is first decorated: set it before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch

# One intra-op thread for the whole session (no test module needs to repeat it): the engine's
# lanes add threads of their own, and on a shared 2-core machine oversubscribed OpenMP threads
# made single requests up to 100x slower.
torch.set_num_threads(1)

from hf_fixtures import HF_CONFIGS, write_hf_checkpoint  # noqa: E402

from pdflash.target.tiny import write_tiny_target  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def aot_cache(tmp_path_factory) -> Path:
    """AOTInductor step packages go to a directory of this session: never the user's cache."""
    from pdflash.target.aot import CACHE_ENV

    directory = tmp_path_factory.mktemp("aot")
    os.environ[CACHE_ENV] = str(directory)
    return directory


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def offloaded(tiny_target):
    """Factory of offloaded targets (default: the tiny checkpoint); every provider is closed afterwards.

    Keywords go to `load_offloaded_target`: device, dtype, expert_cache_fraction, link_gbps, ...
    """
    from pdflash.offload import load_offloaded_target

    made = []

    def make(directory=tiny_target, **options):
        loaded = load_offloaded_target(directory, **options)
        made.append(loaded.model.experts)
        return loaded

    yield make
    for provider in made:
        provider.close()
