"""Per-sequence KV cache: preallocated, grown geometrically, cropped for speculative rollback.

Also owns moving K/V between per-sequence caches and a padded batch (`gather_past`, `store_new`)
for the static-shape steps. Storage is zero-filled when grown, so the rows a length mask hides
are finite (a hidden row is weighted 0, and 0 times a stale NaN would still be NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

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
            grown = torch.zeros((layers, heads, new_capacity, dim), dtype=self.dtype, device=self.device)
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


def gather_past(caches: Sequence[KVCache], keys: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `keys` K/V rows of each cache (capacity >= keys), padded with zero rows to `batch`
    sequences: keys and values [layers, batch, kv_heads, keys, head_dim]. One full cache is
    returned as a view of its whole capacity (no copy; rows past its length are zeros or stale)."""
    if batch == len(caches) == 1:
        return caches[0].keys[:, None], caches[0].values[:, None]
    first = caches[0]
    layers, heads, _, dim = first.shape
    padding = [torch.zeros((layers, heads, keys, dim), dtype=first.dtype, device=first.device)]
    padding *= batch - len(caches)
    return (
        torch.stack([c.keys[:, :, :keys] for c in caches] + padding, dim=1),
        torch.stack([c.values[:, :, :keys] for c in caches] + padding, dim=1),
    )


def store_new(
    caches: Sequence[KVCache], counts: Sequence[int], keys: torch.Tensor, values: torch.Tensor, *, commit: bool
) -> None:
    """Write each cache's first counts[i] new K/V of a padded batch (keys, values [layers, B, kv, n, D])
    after its committed tokens; `commit` advances its length over them."""
    for row, (cache, n) in enumerate(zip(caches, counts, strict=True)):
        cache.keys[:, :, cache.length : cache.length + n] = keys[:, row, :, :n]
        cache.values[:, :, cache.length : cache.length + n] = values[:, row, :, :n]
        if commit:
            cache.advance(n)
