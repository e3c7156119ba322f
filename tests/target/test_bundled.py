"""The bundled pair: shipped as package data, loads, pairs, and speculates losslessly."""

import pytest

from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET, default_drafter, default_target
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator, speculative_generate
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target

MAX_PAIR_BYTES = 25 * 1000 * 1000


@pytest.fixture(scope="module")
def pair():
    loaded = load_target(default_target())
    return loaded, load_drafter(default_drafter(default_target()), loaded.model)


def test_pair_fits_the_size_limit():
    total = sum(f.stat().st_size for d in (BUNDLED_TARGET, BUNDLED_DRAFTER) for f in d.iterdir())
    assert total <= MAX_PAIR_BYTES, f"bundled pair is {total:,} bytes"


def test_only_the_bundled_target_gets_the_bundled_drafter(tiny_target):
    assert default_drafter(default_target()) == BUNDLED_DRAFTER
    assert default_drafter(tiny_target) is None


def test_bundled_target_is_a_real_moe_with_a_partial_verify_union(pair):
    loaded, drafter = pair
    cfg = loaded.model.config
    assert cfg.num_experts >= 32 and cfg.top_k < cfg.num_experts
    assert loaded.tokenizer.token_id("<|mask|>") == drafter.config.mask_token_id
    assert drafter.config.block_size >= 8


def test_greedy_speculation_equals_plain_decoding_on_code(pair):
    loaded, drafter = pair
    prompt = loaded.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n")
    params = SamplingParams(max_tokens=64)
    spec = speculative_generate(Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes), prompt, params)
    assert spec.token_ids == generate_autoregressive(loaded.model, prompt, params).token_ids
    assert max(spec.acceptance_lengths) > 1  # the trained drafter is accepted at least once
