"""Eviction policies of the device expert cache: which unpinned resident expert leaves first.

Owns per-expert bookkeeping (recency, frequency, decayed per-layer routing history) and the
score each policy gives an expert; the lowest score is evicted. It never sees slots, pins
or tensors: the cache offers only candidates that may be evicted. Not thread-safe: the
cache calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from pdflash.target.experts import ExpertKey


class EvictionPolicy(Protocol):
    name: str

    def observe(self, layer: int, union: Iterable[int]) -> None:
        """A forward routed `union` at `layer` (each routed expert counts once per forward)."""

    def forget(self, key: ExpertKey) -> None:
        """`key` left the cache."""

    def score(self, key: ExpertKey) -> tuple:
        """Smaller is evicted first."""


class LRU:
    """Least recently routed first."""

    name = "lru"

    def __init__(self) -> None:
        self.clock = 0
        self.last_used: dict[ExpertKey, int] = {}

    def observe(self, layer: int, union: Iterable[int]) -> None:
        for expert in union:
            self.clock += 1
            self.last_used[(layer, expert)] = self.clock

    def forget(self, key: ExpertKey) -> None:
        self.last_used.pop(key, None)

    def score(self, key: ExpertKey) -> tuple:
        return (self.last_used.get(key, 0),)


class LFU(LRU):
    """Least frequently routed first (counts survive eviction: whole-history frequency), ties by recency."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[ExpertKey, int] = {}

    def observe(self, layer: int, union: Iterable[int]) -> None:
        union = list(union)
        super().observe(layer, union)
        for expert in union:
            self.count[(layer, expert)] = self.count.get((layer, expert), 0) + 1

    def score(self, key: ExpertKey) -> tuple:
        return (self.count.get(key, 0), self.last_used.get(key, 0))


class ActivationAware(LRU):
    """MoE-Infinity style: per layer, exponentially decayed activation counts; least active first.

    Each forward through a layer multiplies that layer's counts by `decay` and adds 1 to
    every routed expert, so an expert's score is Σ decay^age over the forwards that routed
    it. History is kept for evicted experts too: it predicts reuse.

    Ties go to the most recently routed expert. Equal decayed counts mean equal routing
    histories, which at large batches is every expert of every layer, every forward: a
    cyclic scan over the layers larger than the cache. Forwards walk the layers in order,
    so of two experts with the same history the more recently routed one is needed again
    last (Belady's choice); least-recent ties would evict each layer just before its next
    use and hit nothing.
    """

    name = "activation"

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        if not 0.0 < decay < 1.0:
            raise ValueError(f"activation decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.activation: dict[int, dict[int, float]] = {}  # layer -> expert -> decayed count

    def observe(self, layer: int, union: Iterable[int]) -> None:
        union = list(union)
        super().observe(layer, union)
        counts = self.activation.setdefault(layer, {})
        for expert in counts:
            counts[expert] *= self.decay
        for expert in union:
            counts[expert] = counts.get(expert, 0.0) + 1.0

    def score(self, key: ExpertKey) -> tuple:
        return (self.activation.get(key[0], {}).get(key[1], 0.0), -self.last_used.get(key, 0))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {p.name: p for p in (LRU, LFU, ActivationAware)}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"eviction policy {name!r} is unknown; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
