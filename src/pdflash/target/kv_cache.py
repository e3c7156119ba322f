"""Per-sequence KV cache: preallocated, grown geometrically, cropped for speculative rollback."""

from __future__ import annotations

import torch

_MIN_CAPACITY = 64


class KVCache:
    """Keys and values of one sequence for every layer: [layers, kv_heads, capacity, head_dim]."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = (num_layers, num_kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.keys = torch.empty(self.shape, dtype=dtype, device=device)
        self.values = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0  # tokens whose K/V are committed

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        new_capacity = max(_MIN_CAPACITY, capacity * 2, length)
        layers, heads, _, dim = self.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.empty((layers, heads, new_capacity, dim), dtype=self.dtype, device=self.device)
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [kv_heads, n, D] new K/V after the committed ones; return all K/V [kv_heads, length+n, D]."""
        end = self.length + keys.shape[1]
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def crop(self, length: int) -> None:
        """Forget every position at or after `length` (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} must be in 0..{self.length} (the cached length)")
        self.length = length

    def release(self) -> None:
        self.keys = self.values = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.length = 0
