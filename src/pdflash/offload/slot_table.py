"""The device cache's slot table: which expert sits in which arena slot, and which slot to free next.

Owns the entries (an expert's slot, its fetch state, pins and whether a prefetch brought it
in), the free slots, the prefetch claims (key -> unreleased claims on it), and the choice
of a victim when no slot is free: among ready, unpinned entries, unclaimed before claimed,
then the eviction policy's lowest score, and the resident keys as a bitmask kept as they come
and go (read through `ResidentKeys` snapshots). Not thread-safe: the cache (`device_cache`) calls it under
its own lock, and does the counting and the waiting.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import attrs
import torch

from pdflash.target.experts import ExpertKey


class EntryState(enum.Enum):
    LOADING = "loading"  # slot reserved, the lane is (or will be) copying into it
    READY = "ready"
    FAILED = "failed"  # the fetch raised; the entry already left the table and gave its slot back


@attrs.define(eq=False)
class Entry:
    key: ExpertKey
    slot: int
    nbytes: int  # byte-map bytes (as stored)
    requested_at: float  # perf_counter time the fetch was asked for (the emulated link's queueing)
    state: EntryState = EntryState.LOADING
    pins: int = 0  # waves holding it: never evicted while > 0
    prefetched: bool = False  # brought in by a prefetch and not yet used by a forward
    loaded: torch.cuda.Event | None = None  # CUDA: the lane's copy into the slot is done
    error: Exception | None = None


class ResidentKeys(frozenset[ExpertKey]):
    """The keys in the table at one moment, and the same keys as a bitmask the table keeps as
    they come and go (bit layer * experts_per_layer + expert): whoever numbers experts that way
    (the admission tick, on a grid byte map) reads the set as one int, not key by key."""

    __slots__ = ("mask", "experts_per_layer")
    mask: int
    experts_per_layer: int

    def __new__(cls, keys: Iterable[ExpertKey], mask: int, experts_per_layer: int) -> ResidentKeys:
        snapshot = super().__new__(cls, keys)
        snapshot.mask, snapshot.experts_per_layer = mask, experts_per_layer
        return snapshot


class SlotTable:
    """`num_slots` slots, each empty or holding one expert's entry."""

    def __init__(self, num_slots: int, experts_per_layer: int) -> None:
        self.num_slots = num_slots
        self.entries: dict[ExpertKey, Entry] = {}
        self.experts_per_layer = experts_per_layer
        self._mask = 0  # the keys of `entries`, bit layer * experts_per_layer + expert
        self.claims: dict[ExpertKey, int] = {}  # key -> unreleased claims on it
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def occupied(self) -> int:
        """Slots holding an entry (reserved or ready)."""
        return self.num_slots - len(self._free)

    def claim(self, keys: Iterable[ExpertKey]) -> None:
        for key in keys:
            self.claims[key] = self.claims.get(key, 0) + 1

    def unclaim(self, keys: Iterable[ExpertKey]) -> None:
        drop_claims(self.claims, keys)

    def add(self, entry: Entry) -> None:
        bit = self._bit(entry.key)
        self.entries[entry.key] = entry
        self._mask |= bit

    def resident(self) -> ResidentKeys:
        """The keys of every entry now (reserved or ready)."""
        return ResidentKeys(self.entries, self._mask, self.experts_per_layer)

    def victim(self, score: Callable[[ExpertKey], tuple], *, allow_claimed: bool) -> Entry | None:
        """The entry to evict for a slot: ready, unpinned (and unclaimed unless `allow_claimed`),
        unclaimed ones first, then the lowest `score`; None if no entry may go."""
        candidates = [
            e
            for e in self.entries.values()
            if e.state is EntryState.READY and e.pins == 0 and (allow_claimed or e.key not in self.claims)
        ]
        return min(candidates, key=lambda e: (e.key in self.claims, score(e.key)), default=None)

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def remove(self, entry: Entry) -> None:
        """`entry` leaves the table; its slot is free again."""
        self._mask &= ~self._bit(entry.key)
        del self.entries[entry.key]
        self._free.append(entry.slot)

    def _bit(self, key: ExpertKey) -> int:
        layer, expert = key
        if not (0 <= expert < self.experts_per_layer and layer >= 0):
            raise ValueError(f"expert {key!r} is not a (layer >= 0, expert < {self.experts_per_layer}) pair")
        return 1 << (layer * self.experts_per_layer + expert)


def drop_claims(claims: dict[ExpertKey, int], keys: Iterable[ExpertKey]) -> None:
    """One claim fewer on each of `keys` (key -> unreleased claims); a key at none leaves `claims`."""
    for key in keys:
        left = claims.get(key, 0) - 1
        if left > 0:
            claims[key] = left
        else:
            claims.pop(key, None)
