"""The registered verify demands as columns: what a tick reads, without rebuilding a set per demand.

Owns one slot per registered demand (its tokens, expected tokens and, with byte masks, its
union as an int mask over the scheduler's `ExpertMasks`, built once: at registration, off the
tick that charges it, or, while ticks admit every demand without reading one
(pdflash.engine.scheduler), when a tick first reads it), the
mask of what a tick charges against (resident, tracked by its differences, ∪ in flight, whose
registered parts are found by identity) and the bytes each union adds to it alone (the yield
order's denominator: a few big-int operations per union, which after a forward, with cold
caches, cost less than numpy's passes over rows of packed words: 55 µs against 82 for 64
Qwen3-30B-A3B-sized unions, bench_admission.py).
pdflash.engine.charging defines the charges. Knows nothing of tickets, budgets or order policies.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from pdflash.engine.charging import ExpertMasks, TrackedRow, UnionOf, row_mask
from pdflash.target.experts import ExpertKey

EMPTY = 0  # a slot never given to a demand


class DemandTable:
    """Slots of demand columns: `add` at registration, `set` on a re-registration, `free` when it leaves."""

    def __init__(self, masks: ExpertMasks | None, capacity: int = 64) -> None:
        self.masks = masks
        self._held: dict[int, int] = {}  # slot -> tokens of its demand, for the slots holding one
        self._token_counts: dict[int, int] = {}  # tokens -> demands registered with that many
        self.expected: list[float] = [0.0] * capacity  # [slots] E[tokens its verify commits]
        self._masks_of: list[int | None] = [None] * capacity  # [slots] each union's int mask, once built
        self._union_of: list[frozenset[ExpertKey]] = [frozenset()] * capacity  # [slots] each union
        self._free = list(range(capacity - 1, EMPTY, -1))  # popped from the end: lowest slot first
        self._unions: dict[int, tuple[frozenset[ExpertKey], int]] = {}  # id(union) -> (union, slot), as registered
        self._union_ids: dict[int, int] = {}  # slot -> id(its union), the key above
        self._resident = TrackedRow(masks) if masks is not None else None

    def add(self) -> int:
        """A free slot (then `set` its demand)."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def set(
        self, slot: int, tokens: int, expected_tokens: float, union: frozenset[ExpertKey], *, build: bool = True
    ) -> None:
        """The demand of `slot` (a re-registration replaces the one it had); its union's mask is
        built now, or (`build` False) when first read."""
        self._forget(slot)
        self.expected[slot] = expected_tokens
        self._held[slot] = tokens
        self._token_counts[tokens] = self._token_counts.get(tokens, 0) + 1
        if self.masks is not None:
            self._masks_of[slot], self._union_of[slot] = None, union
            if build:
                self.mask(slot)
            self._unions[id(union)] = (union, slot)  # a part of an in-flight UnionOf later
            self._union_ids[slot] = id(union)

    def free(self, slot: int) -> None:
        self._forget(slot)
        self._masks_of[slot], self._union_of[slot] = None, frozenset()
        self._free.append(slot)

    def mask(self, slot: int) -> int:
        """The int mask of `slot`'s union (built on the first call after its registration)."""
        built = self._masks_of[slot]
        if built is None:
            assert self.masks is not None
            built = self._masks_of[slot] = row_mask(self.masks.row_of(self._union_of[slot]))
        return built

    def fewest_tokens(self) -> int:
        """The fewest tokens any registered demand holds (a lower bound on every waiting one's)."""
        return min(self._token_counts, default=0)

    def covered(self, resident: Set[ExpertKey], in_flight: Set[ExpertKey]) -> tuple[int, frozenset[int]]:
        """The mask of resident ∪ in flight (a registered union's mask is looked up, not built),
        and the slots whose unions are parts of the in-flight set (so covered: charged nothing)."""
        assert self.masks is not None and self._resident is not None
        covered, inside = self._resident.mask_of(resident), []
        for part in in_flight.parts if isinstance(in_flight, UnionOf) else (in_flight,):
            known = self._unions.get(id(part))
            if known is not None and known[0] is part:
                covered |= self.mask(known[1])
                inside.append(known[1])
            elif part:
                covered |= self.masks.mask(part)
        return covered, frozenset(inside)

    def alone_bytes(self, slots: Sequence[int], covered: int) -> list[int]:
        """[n] bytes the union of each of `slots` adds to the mask `covered`, each as if alone."""
        assert self.masks is not None
        masks, uncovered = self.masks, self.masks.everything & ~covered
        if masks.one_size is not None:
            return [masks.one_size * (self.mask(s) & uncovered).bit_count() for s in slots]
        return [masks.nbytes(self.mask(s) & uncovered) for s in slots]

    def _forget(self, slot: int) -> None:
        """`slot`'s demand is no longer registered, nor its union (unless another slot registered the same object since)."""
        tokens = self._held.pop(slot, None)
        if tokens is not None:
            left = self._token_counts.pop(tokens) - 1
            if left:
                self._token_counts[tokens] = left
        key = self._union_ids.pop(slot, None)
        if key is not None and self._unions.get(key, (None, EMPTY))[1] == slot:
            del self._unions[key]

    def _grow(self) -> None:
        n = len(self.expected)
        self.expected += [0.0] * n
        self._masks_of += [None] * n
        self._union_of += [frozenset()] * n
        self._free = list(range(2 * n - 1, n - 1, -1))
