"""`pdflash bench --calibrate` on a tiny pair: every phase fitted, and the engine's step overhead measured."""

import pytest

from pdflash.bench.calibrate import calibrate
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate-pair")
    target = write_tiny_target(root / "target", seed=0)
    return target, write_tiny_drafter(root / "drafter", target, block_size=4)


def test_calibration_fits_every_phase_and_the_engine_step(pair):
    target, drafter = pair
    pool = [[5 + i, 9, 11 + i, 40] for i in range(8)]
    phases = []
    costs = calibrate(target, drafter, pool, progress=phases.append)
    assert phases[0] == "warm-up" and len(phases) > 1
    for fit in (costs.prefill, costs.drafter, costs.projection, costs.verify, costs.resident_verify):
        assert fit is not None
    assert costs.step_s(16) > 0  # seconds per batched verify outside the forwards, from a live engine
