"""Compiled steps on CUDA (CUDA graphs through `reduce-overhead`): greedy AR and batched DFlash equal eager.

Not yet run on a GPU (none was lent when these were written); `PDFLASH_TEST_DEVICE=cpu` runs
them through inductor on the CPU instead.
"""

import pytest

from pdflash.sampling import SamplingParams
from pdflash.spec.speculator import Speculator
from pdflash.spec.step_install import install_steps
from pdflash.target.generate import generate_autoregressive

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=32)


def test_compiled_ar_and_batched_dflash_on_the_device_equal_eager(bundled_fp32, code_prompts):
    model, drafter = bundled_fp32.loaded.model, bundled_fp32.drafter
    spec = Speculator(model, drafter, expert_nbytes=bundled_fp32.loaded.expert_nbytes, projector="last-union")

    def dflash() -> list[list[int]]:
        sessions = spec.begin_sessions([(p, GREEDY) for p in code_prompts])
        while not all(s.finished for s in sessions):
            live = [s for s in sessions if not s.finished]
            spec.draft_rounds(live)
            spec.verify_rounds(live)
        return [list(s.emitted) for s in sessions]

    ar_eager = [generate_autoregressive(model, p, GREEDY).token_ids for p in code_prompts]
    dflash_eager = dflash()
    install_steps(spec, max_batch=len(code_prompts), compiled=True)
    try:
        assert [generate_autoregressive(model, p, GREEDY).token_ids for p in code_prompts] == ar_eager
        assert dflash() == dflash_eager
        assert not any("batch bucket" in reason for reason in model.steps.fallbacks)
    finally:
        model.steps = drafter.steps = None
