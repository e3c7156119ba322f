"""Cost models of the simulator: how long each forward takes, in seconds, on a virtual clock.

Two models answer the same questions. `CalibratedCosts` are linear fits of per-forward times
measured on this machine (`pdflash bench --calibrate`); `RooflineCosts` follow from a
profile's shapes and accelerator (per-layer fixed cost + max(HBM time, FLOP time)). Copies
are not here: the simulated copy engine charges bytes / link rate. Must not simulate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np

from pdflash.bench.profiles import Profile


class CostModel(Protocol):
    description: str

    def prefill_s(self, tokens: int, seqs: int, experts: int) -> float: ...
    def draft_s(self, seqs: int, tokens: int, *, speculative: bool, router: bool) -> float: ...
    def verify_s(self, tokens: int, seqs: int, experts: int) -> float: ...
    def step_s(self, seqs: int) -> float: ...


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Least-squares (intercept, slopes...) of ys over the columns of xs, clamped at >= 0."""
    design = np.column_stack([np.ones(len(ys)), np.asarray(xs, dtype=float)])
    coef, *_ = np.linalg.lstsq(design, np.asarray(ys, dtype=float), rcond=None)
    return tuple(max(0.0, float(c)) for c in coef)


def _line(coef: Sequence[float], *xs: float) -> float:
    return coef[0] + sum(c * x for c, x in zip(coef[1:], xs, strict=True))


@attrs.frozen(kw_only=True)
class CalibratedCosts:
    """Per-forward times measured here: each a linear fit (intercept first, seconds)."""

    prefill: tuple[float, float]  # over prompt tokens
    drafter: tuple[float, float]  # drafter forward, over sequences (one block each)
    projection: tuple[float, float]  # router-only pass, over block tokens
    verify: tuple[float, float, float]  # over tokens and distinct experts of the batch
    step: tuple[float, float]  # engine bookkeeping per step, over live sequences
    machine: str = ""
    description: str = "calibrated on this machine"

    def prefill_s(self, tokens: int, seqs: int, experts: int) -> float:
        return _line(self.prefill, tokens)

    def draft_s(self, seqs: int, tokens: int, *, speculative: bool, router: bool) -> float:
        drafter = _line(self.drafter, seqs) if speculative else 0.0
        return drafter + (_line(self.projection, tokens) if router else 0.0)

    def verify_s(self, tokens: int, seqs: int, experts: int) -> float:
        return _line(self.verify, tokens, experts)

    def step_s(self, seqs: int) -> float:
        return _line(self.step, seqs)

    def to_json(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(attrs.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: Path | str) -> CalibratedCosts:
        data = json.loads(Path(path).read_text())
        fields = {f.name for f in attrs.fields(cls)}
        missing = sorted({"prefill", "drafter", "projection", "verify", "step"} - set(data))
        if missing:
            raise ValueError(f"{path}: calibration lacks {missing}; write it with `pdflash bench --calibrate`")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields})


@attrs.frozen
class RooflineCosts:
    """A profile's accelerator: every forward = layers x fixed cost + max(bytes / HBM, FLOPs / peak)."""

    profile: Profile
    step_overhead_s: float = 0.0  # engine bookkeeping per step (0: not modelled at real scale)

    @property
    def description(self) -> str:
        a = self.profile.accelerator
        return (
            f"roofline on {a.name}: {a.hbm_bytes_per_s / 1e12:g} TB/s HBM, {a.per_layer_fixed_s * 1e6:g} µs per layer"
        )

    def prefill_s(self, tokens: int, seqs: int, experts: int) -> float:
        return self.profile.forward_s(tokens, experts)

    def verify_s(self, tokens: int, seqs: int, experts: int) -> float:
        return self.profile.forward_s(tokens, experts)

    def draft_s(self, seqs: int, tokens: int, *, speculative: bool, router: bool) -> float:
        m, a = self.profile.model, self.profile.accelerator
        total = 0.0
        if speculative:
            flops = 2 * tokens * m.drafter_bytes_per_forward / 2
            total += m.drafter_layers * a.per_layer_fixed_s + max(
                m.drafter_bytes_per_forward / a.hbm_bytes_per_s, flops / a.peak_flops
            )
        if router:
            total += m.num_hidden_layers * a.per_layer_fixed_s + m.router_pass_bytes / a.hbm_bytes_per_s
        return total

    def step_s(self, seqs: int) -> float:
        return self.step_overhead_s
