"""Cost models of the simulator: how long each forward takes, in seconds, on a virtual clock.

Two models answer the same questions. `CalibratedCosts` are linear fits of per-forward times
measured on this machine (`pdflash bench --calibrate`); `RooflineCosts` follow from a
profile's shapes and accelerator (per-layer fixed cost + max(HBM time, FLOP time)). Copies
are not here: the simulated copy engine charges bytes / link rate. Must not simulate.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from pdflash.bench.profiles import Profile


class CostModel(Protocol):
    @property
    def description(self) -> str: ...

    # Target forwards return (dense_s, expert_s): the part a layer computes before its MoE block
    # waits for experts (attention, routing) and the expert compute, each summed over layers.
    def prefill_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]: ...
    def draft_s(self, seqs: int, tokens: int, context: int, *, speculative: bool, router: bool) -> float: ...
    def verify_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]: ...
    # a verify of `tokens` over `seqs` sequences with `prompts` prompts (`prompt_tokens`) prefilled in its forward
    def mixed_s(
        self, tokens: int, seqs: int, prompt_tokens: int, prompts: int, experts: int, *, offloaded: bool
    ) -> tuple[float, float]: ...
    def step_s(self, seqs: int) -> float: ...


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Non-negative least squares of relative error: (intercept, slopes...) of ys over the
    columns of xs minimising sum(((fit - y) / y)^2), so a 3 ms forward weighs as much as a
    50 ms one. The best unconstrained fit over every subset of the terms whose coefficients
    all come out >= 0 (exact for the few terms a cost has; a negative cost would be nonsense)."""
    y = np.asarray(ys, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-9)
    design = np.column_stack([np.ones(len(ys)), np.asarray(xs, dtype=float)]) * weight[:, None]  # [n, 1 + terms]
    target = y * weight
    best, best_residual = np.zeros(design.shape[1]), float(np.sum(target**2))
    for subset in itertools.product((False, True), repeat=design.shape[1]):
        if not any(subset):
            continue
        cols = np.flatnonzero(subset)
        coef, *_ = np.linalg.lstsq(design[:, cols], target, rcond=None)
        residual = float(np.sum((design[:, cols] @ coef - target) ** 2))
        if (coef >= 0).all() and residual < best_residual:
            best, best_residual = np.zeros(design.shape[1]), residual
            best[cols] = coef
    return tuple(float(c) for c in best)


def _line(coef: Sequence[float], *xs: float) -> float:
    return coef[0] + sum(c * x for c, x in zip(coef[1:], xs, strict=True))


@attrs.frozen(kw_only=True)
class CalibratedCosts:
    """Per-forward times measured here: each a linear fit (intercept first, seconds)."""

    prefill: tuple[float, ...]  # offloaded target: (s, s/token, s/sequence) over prompt tokens and sequences
    drafter: tuple[float, ...]  # drafter forward: (s, s/sequence, s/new context feature)
    projection: tuple[float, ...]  # router-only pass: (s, s/block token, s/sequence)
    verify: tuple[float, ...]  # offloaded target: (s, s/token, s/distinct expert of the batch, s/sequence)
    resident_prefill: tuple[float, ...]  # resident target, as prefill
    resident_verify: tuple[float, ...]  # resident target, as verify
    step: tuple[float, ...]  # engine bookkeeping per step: (s, s/live sequence)
    machine: str = ""
    description: str = "calibrated on this machine"

    def prefill_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]:
        return _line(self.prefill if offloaded else self.resident_prefill, tokens, seqs), 0.0

    def draft_s(self, seqs: int, tokens: int, context: int, *, speculative: bool, router: bool) -> float:
        drafter = _line(self.drafter, seqs, context) if speculative else 0.0
        return drafter + (_line(self.projection, tokens, seqs) if router else 0.0)

    def verify_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]:
        fit = self.verify if offloaded else self.resident_verify
        expert_s = fit[2] * experts
        return _line(fit, tokens, experts, seqs) - expert_s, expert_s

    def mixed_s(
        self, tokens: int, seqs: int, prompt_tokens: int, prompts: int, experts: int, *, offloaded: bool
    ) -> tuple[float, float]:
        """The verify's fit over the whole batch's experts, plus what the prefill fit charges per
        prompt token and prompt (not its fixed seconds: the verify's forward pays those)."""
        dense_s, expert_s = self.verify_s(tokens, seqs, experts, offloaded=offloaded)
        fit = self.prefill if offloaded else self.resident_prefill
        return dense_s + _line(fit, prompt_tokens, prompts) - fit[0], expert_s

    def step_s(self, seqs: int) -> float:
        return _line(self.step, seqs)

    def ar_step_s(self, experts: int) -> float:
        """One resident autoregressive step of one sequence routing `experts` experts (a verify of
        one token and the engine's bookkeeping): what `pdflash bench` times to set its time scale."""
        return sum(self.verify_s(1, 1, experts, offloaded=False)) + self.step_s(1)

    def scaled(self, factor: float) -> CalibratedCosts:
        """Every forward and the bookkeeping `factor` times as long (the machine under another load)."""
        if not factor > 0:
            raise ValueError(f"a compute scale must be > 0, got {factor!r}")
        fits: dict[str, Any] = {
            f.name: tuple(c * factor for c in getattr(self, f.name))
            for f in attrs.fields(CalibratedCosts)
            if f.name not in ("machine", "description")
        }
        return attrs.evolve(self, **fits, description=f"{self.description}, scaled x{factor:.2f}")

    def to_json(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(attrs.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: Path | str) -> CalibratedCosts:
        data = json.loads(Path(path).read_text())
        fields = {f.name for f in attrs.fields(cls)}
        missing = sorted(fields - {"machine", "description"} - set(data))
        if missing:
            raise ValueError(f"{path}: calibration lacks {missing}; write it with `pdflash bench --calibrate`")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
        return cls(**values)


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

    def prefill_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]:
        return self._split(tokens, experts)

    def verify_s(self, tokens: int, seqs: int, experts: int, *, offloaded: bool) -> tuple[float, float]:
        return self._split(tokens, experts)

    def mixed_s(
        self, tokens: int, seqs: int, prompt_tokens: int, prompts: int, experts: int, *, offloaded: bool
    ) -> tuple[float, float]:
        return self._split(tokens + prompt_tokens, experts)  # one forward over every token

    def _split(self, tokens: int, experts: int) -> tuple[float, float]:
        """The roofline time, split by the share of the bytes read that are experts'."""
        m = self.profile.model
        total = self.profile.forward_s(tokens, experts)
        expert_bytes = experts * m.expert_bytes
        expert_s = total * expert_bytes / (expert_bytes + m.dense_bytes_per_forward)
        return total - expert_s, expert_s

    def draft_s(self, seqs: int, tokens: int, context: int, *, speculative: bool, router: bool) -> float:
        m, a = self.profile.model, self.profile.accelerator
        total = 0.0
        if speculative:
            flops = 2 * (tokens + context) * m.drafter_bytes_per_forward / 2
            total += m.drafter_layers * a.per_layer_fixed_s + max(
                m.drafter_bytes_per_forward / a.hbm_bytes_per_s, flops / a.peak_flops
            )
        if router:
            total += m.num_hidden_layers * a.per_layer_fixed_s + m.router_pass_bytes / a.hbm_bytes_per_s
        return total

    def step_s(self, seqs: int) -> float:
        return self.step_overhead_s
