"""`pdflash bench --calibrate` on a tiny pair: every phase fitted, and the engine's step overhead measured."""

from pdflash.bench.calibrate import calibrate


def test_calibration_fits_every_phase_and_the_engine_step(pair):
    target, drafter = pair
    pool = [[5 + i, 9, 11 + i, 40] for i in range(8)]
    phases = []
    costs = calibrate(target, drafter, pool, progress=phases.append)
    assert phases[0] == "warm-up" and len(phases) > 1
    for fit in (costs.prefill, costs.drafter, costs.projection, costs.verify, costs.resident_verify):
        assert fit is not None
    assert costs.step_s(16) > 0  # seconds per batched verify outside the forwards, from a live engine
