"""Rotary position embeddings: inverse frequencies for default / linear / YaRN, and their application."""

from __future__ import annotations

import math

import torch

from pdflash.target.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """[head_dim/2] float32 inverse frequencies and the cos/sin scale (YaRN attention factor)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # [D/2]
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    return _yarn(rope, head_dim, inv_freq)


def _yarn(rope: RopeConfig, head_dim: int, extrapolation: torch.Tensor) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(rope.factor)

    original = rope.original_max_positions
    if original is None:
        raise ValueError("yarn RoPE needs original_max_positions (the pre-training context length)")

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    keep = 1 - ramp  # share of extrapolation per frequency
    inv_freq = extrapolation / rope.factor * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


class Rotary:
    """cos/sin tables by absolute position; applies rotate-half RoPE to [.., n, D] tensors."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.inv_freq, self.scale = inverse_frequencies(rope, head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, D]; cos, sin: [n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
