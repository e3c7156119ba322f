"""The device cache's slot table: which expert sits in which arena slot, and which slot to free next.

Owns the entries (an expert's slot, its fetch state, pins and whether a prefetch brought it
in), the free slots, the prefetch claims (key -> unreleased claims on it), and the choice
of a victim when no slot is free: among ready, unpinned entries, unclaimed ones by the
eviction policy's lowest score, then claimed ones needed last (Belady's choice over the
claims' known order), and the resident keys as a bitmask kept as they come
and go (read through `ResidentKeys` snapshots). Not thread-safe: the cache (`device_cache`) calls it under
its own lock, and does the counting and the waiting.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from collections.abc import Callable, Container, Iterable

import attrs
import torch

from pdflash.target.experts import ExpertKey

NextUse = tuple[int, int]  # (claim order, layer): when a claimed forward first needs an expert
# A claim whose forward has passed a layer keeps that layer's keys at its order + PASSED: needed
# after every claim still ahead (its sequences' next round is likely to route them again), so
# fetches with a known need may take their slots, and cold unclaimed experts still go first.
PASSED = 1 << 40


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
        self.claims: dict[ExpertKey, list[int]] = {}  # key -> the orders of its unreleased claims, ascending
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def occupied(self) -> int:
        """Slots holding an entry (reserved or ready)."""
        return self.num_slots - len(self._free)

    def claim(self, keys: Iterable[ExpertKey], order: int) -> None:
        """Claims numbered in the order their forwards will run (`order` grows from call to call)."""
        add_claims(self.claims, keys, order)

    def unclaim(self, keys: Iterable[ExpertKey], order: int) -> None:
        drop_claims(self.claims, keys, order)

    def next_use(self, key: ExpertKey) -> NextUse | None:
        return next_use(self.claims, key)

    def add(self, entry: Entry) -> None:
        bit = self._bit(entry.key)
        self.entries[entry.key] = entry
        self._mask |= bit

    def resident(self) -> ResidentKeys:
        """The keys of every entry now (reserved or ready)."""
        return ResidentKeys(self.entries, self._mask, self.experts_per_layer)

    def victim(self, score: Callable[[ExpertKey], tuple], *, needed_at: NextUse | None) -> Entry | None:
        """The entry to evict for a slot: ready and unpinned; unclaimed ones first, by the lowest
        `score`, then claimed ones, the one needed last first. For a fetch `needed_at` a claimed
        forward's (order, layer), only entries needed after it may go; None (a forward's own
        miss, needed now): any. None if no entry may go."""
        best: Entry | None = None
        best_rank: tuple = ()
        for e in self.entries.values():
            if e.state is not EntryState.READY or e.pins:
                continue
            use = self.next_use(e.key)
            if use is None:
                rank: tuple = (0, score(e.key))
            elif needed_at is None or use > needed_at:
                rank = (1, -use[0], -use[1])
            else:
                continue
            if best is None or rank < best_rank:
                best, best_rank = e, rank
        return best

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


def add_claims(claims: dict[ExpertKey, list[int]], keys: Iterable[ExpertKey], order: int) -> None:
    """One claim more on each of `keys` (key -> the orders of its claims, ascending)."""
    for key in keys:
        bisect.insort(claims.setdefault(key, []), order)


def drop_claims(claims: dict[ExpertKey, list[int]], keys: Iterable[ExpertKey], order: int) -> None:
    """The claim `order` ends on each of `keys`; a key with none left leaves `claims`."""
    for key in keys:
        orders = claims.get(key)
        if orders is not None and order in orders:
            orders.remove(order)
            if not orders:
                del claims[key]


def pass_claims(claims: dict[ExpertKey, list[int]], keys: Iterable[ExpertKey], order: int) -> None:
    """The forward of claim `order` has computed `keys`' layer: they are next needed after every
    claim ahead (order + PASSED), until the claim is released."""
    keys = list(keys)
    drop_claims(claims, keys, order)
    add_claims(claims, keys, order + PASSED)


def next_use(claims: dict[ExpertKey, list[int]], key: ExpertKey) -> NextUse | None:
    """When a claimed forward needs `key` first: (its claim's order, the key's layer); None if unclaimed."""
    orders = claims.get(key)
    return (orders[0], key[0]) if orders else None


class WantedKeys:
    """Claimed keys not yet resident, handed out the one a claimed forward needs soonest first
    (lower priority value first, then (claim order, layer)). A key's need only moves later
    (claims are numbered as they come and end oldest-first per key), so a heap with its entries
    re-checked when they surface keeps each hand-out O(log n)."""

    def __init__(self) -> None:
        self.keys: dict[ExpertKey, tuple[int, float]] = {}  # key -> (priority, perf_counter/virtual time asked)
        self._heap: list[tuple[int, NextUse, ExpertKey]] = []
        self.dropped = 0  # keys whose claims all ended before they were handed out

    def add(self, key: ExpertKey, priority: int, requested_at: float, use: NextUse) -> None:
        known = self.keys.get(key)
        if known is None or priority < known[0]:
            self.keys[key] = (priority, known[1] if known is not None else requested_at)
            heapq.heappush(self._heap, (priority, use, key))

    def soonest(
        self, next_use: Callable[[ExpertKey], NextUse | None], resident: Container[ExpertKey]
    ) -> tuple[ExpertKey, NextUse] | None:
        """The key to fetch next and its need, left wanted until `take`; keys resident meanwhile
        leave, and keys no longer claimed leave as dropped."""
        heap = self._heap
        while heap:
            priority, use, key = heap[0]
            known = self.keys.get(key)
            if known is None or known[0] != priority:  # taken, or re-added at a higher priority
                heapq.heappop(heap)
                continue
            now = next_use(key)
            if key in resident or now is None:
                heapq.heappop(heap)
                del self.keys[key]
                self.dropped += key not in resident
                continue
            if now != use:
                heapq.heapreplace(heap, (priority, now, key))
                continue
            return key, use
        return None

    def take(self, key: ExpertKey) -> None:
        del self.keys[key]
