"""The registered verify demands as columns: what a tick reads, without touching a Python object per demand.

Owns one slot per registered demand (its tokens, expected tokens, the tick it was queued at
and, with byte masks, its union's row of packed words over the scheduler's `ExpertMasks`),
the row of what a tick charges against (resident, tracked by its differences, ∪ in flight,
whose registered parts are found by identity), the scratch buffer a tick counts in, and
gathering a tick's line, so that charging and ordering 256 Qwen3-30B-A3B-sized unions are a
handful of vectorized operations over rows built once, at registration
(pdflash.engine.charging defines the charges). Knows nothing of tickets, budgets or order policies.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import numpy as np
import numpy.typing as npt

from pdflash.engine.charging import ExpertMasks, LazyMarginal, Rows, TrackedRow, UnionOf, without
from pdflash.target.experts import ExpertKey

Slots = npt.NDArray[np.intp]  # [n] slot numbers, a tick's line in order
EMPTY = 0  # the slot whose row stays empty (never a demand's): row 0 of a tick's gathers


class DemandTable:
    """Slots of demand columns: `add` at registration, `set` on a re-registration, `free` when it leaves."""

    def __init__(self, masks: ExpertMasks | None, capacity: int = 64) -> None:
        self.masks = masks
        self.words = masks.words if masks is not None else 0
        self.tokens = np.zeros(capacity, dtype=np.int64)  # [slots] tokens in the block to verify
        self.expected = np.zeros(capacity, dtype=np.float64)  # [slots] E[tokens its verify commits]
        self.queued_tick = np.zeros(capacity, dtype=np.int64)  # [slots] ticks run when it was first queued
        self._rows: Rows = np.zeros((capacity, self.words), dtype=np.uint64)  # [slots, words] union rows
        self._counts = np.zeros((capacity, self.words), dtype=np.uint8)  # [slots, words] popcount scratch
        self._free = list(range(capacity - 1, EMPTY, -1))  # popped from the end: lowest slot first
        self._unions: dict[int, tuple[frozenset[ExpertKey], int]] = {}  # id(union) -> (union, slot), as registered
        self._union_ids: dict[int, int] = {}  # slot -> id(its union), the key above
        self._resident = TrackedRow(masks) if masks is not None else None

    def add(self, queued_tick: int) -> int:
        """A free slot, queued at `queued_tick` (then `set` its demand)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.queued_tick[slot] = queued_tick
        return slot

    def set(self, slot: int, tokens: int, expected_tokens: float, union: frozenset[ExpertKey]) -> None:
        """The demand of `slot` (a re-registration replaces the one it had)."""
        self._forget(slot)
        self.tokens[slot], self.expected[slot] = tokens, expected_tokens
        if self.masks is not None:
            self._rows[slot] = self.masks.row_of(union)
            self._unions[id(union)] = (union, slot)  # a part of an in-flight UnionOf later
            self._union_ids[slot] = id(union)

    def covered(self, resident: Set[ExpertKey], in_flight: Set[ExpertKey]) -> Rows:
        """[words] the row of resident ∪ in flight (a registered union's row is looked up, not built)."""
        assert self.masks is not None and self._resident is not None
        covered = self._resident.of(resident).copy()
        slots = [EMPTY]
        for part in in_flight.parts if isinstance(in_flight, UnionOf) else (in_flight,):
            known = self._unions.get(id(part))
            if known is not None and known[0] is part:
                slots.append(known[1])
            elif part:
                covered |= self.masks.row_of(part)
        return covered | np.bitwise_or.reduce(self._rows.take(slots, axis=0), axis=0)

    def free(self, slot: int) -> None:
        self._forget(slot)
        self._free.append(slot)

    def _forget(self, slot: int) -> None:
        """`slot`'s union is no longer registered (unless another slot registered the same object since)."""
        key = self._union_ids.pop(slot, None)
        if key is not None and self._unions.get(key, (None, EMPTY))[1] == slot:
            del self._unions[key]

    def alone_bytes(self, slots: Slots, covered: Rows) -> npt.NDArray[np.int64]:
        """[n] bytes the union of each of `slots` adds to `covered` ([words]), each as if alone."""
        assert self.masks is not None
        return self.masks.row_bytes(without(self._rows.take(slots, axis=0), covered), self._counts)

    def marginal(self, covered: Rows, slots: Slots) -> LazyMarginal:
        """[n] marginal charges of the unions of `slots` in that order, beyond `covered` ([words]),
        counted as they are read (`charging.LazyMarginal`, in this table's scratch)."""
        assert self.masks is not None
        return LazyMarginal(
            self.masks, covered, len(slots), lambda lo, hi: self._rows.take(slots[lo:hi], axis=0), self._counts
        )

    def _grow(self) -> None:
        n = len(self.tokens)
        self.tokens, self.expected, self.queued_tick = (
            np.concatenate([c, np.zeros_like(c)]) for c in (self.tokens, self.expected, self.queued_tick)
        )
        self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        self._counts = np.zeros((2 * n, self.words), dtype=np.uint8)
        self._free = list(range(2 * n - 1, n - 1, -1))


def slots_of(slots: Sequence[int]) -> Slots:
    return np.asarray(slots, dtype=np.intp)
