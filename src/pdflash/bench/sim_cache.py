"""The simulated device expert cache and its serial copy engine, on a virtual clock.

Mirrors `pdflash.offload.device_cache` without tensors or threads: a table of experts in
slots, pins held by the layer a forward is running, numbered claims held by route-ahead
prefetches (stepping back once their verify's forward passed the layer) until their verify
ran (`release`), and
the REAL eviction policy (`make_policy`) choosing among unpinned ready experts (unclaimed by
lowest score, then the claimed needed last). One serial copy engine runs on-demand copies
first, else the claimed key needed soonest (waiting while no slot can be freed for it), each
taking bytes / link rate, like the emulated link's pipe. Counts in the real cache's
`Counters`. Must not schedule or compute.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import attrs

from pdflash.offload.cache_stats import Counters
from pdflash.offload.eviction import make_policy
from pdflash.offload.prefetch import Priority
from pdflash.offload.slot_table import PASSED, NextUse, WantedKeys, add_claims, drop_claims, next_use, pass_claims
from pdflash.target.experts import ExpertKey

_NEVER: NextUse = (sys.maxsize, sys.maxsize)  # no claimed forward needs an expert after this


class SimulationError(ValueError):
    """The simulated configuration cannot run (the message says which value)."""


@attrs.define(eq=False)
class _Entry:
    key: ExpertKey
    nbytes: int
    ready_at: float = math.inf  # virtual time its copy lands (inf: not started)
    pins: int = 0
    prefetched: bool = False  # brought in by a prefetch, not yet used
    seq: int = 0  # insertion order into the table (the real table's iteration order: its ties)


@attrs.define(eq=False)
class _Job:
    key: ExpertKey
    requested_at: float
    reserved: _Entry  # the forward reserved its slot already


@attrs.define(eq=False)
class SimClaim:
    """One route-ahead prefetch's claim, as `offload.device_cache.ExpertClaim`."""

    keys: tuple[ExpertKey, ...]
    order: int
    passed: set[int] = attrs.Factory(set)  # layers its verify's forward has computed


class SimCache:
    """Slots, pins, claims, the eviction policy and the copy engine of one simulated run."""

    def __init__(
        self,
        byte_map: Mapping[ExpertKey, int],
        *,
        slots: int,
        link_bytes_per_s: float,
        policy: str,
        claims_per_layer: bool = False,  # the lock-step engine's cache: a forward reaching a layer ends its claims,
        # and a prefetch that finds no slot is dropped
    ) -> None:
        if slots < 2:
            raise SimulationError(f"the simulated expert cache holds {slots} experts; it needs at least 2")
        self.byte_map, self.slots, self.rate = byte_map, slots, link_bytes_per_s
        self.policy = make_policy(policy)
        self.table: dict[ExpertKey, _Entry] = {}
        self.counters = Counters()  # the real cache's counters (the subset a simulation moves)
        self._queue: deque[_Job] = deque()  # on-demand copies, in the order asked
        self._link_free_at = 0.0
        self.claims: dict[ExpertKey, list[int]] = {}  # key -> the orders of its unreleased claims, ascending
        self._claim_orders = itertools.count()
        self.wanted = WantedKeys()  # claimed keys not resident, the soonest needed first
        self._parked = False  # no slot could be freed for the key needed soonest, until pins or claims change
        self.claims_per_layer = claims_per_layer
        self._lane_victims: list[_Entry] | None = None  # unclaimed candidates; valid until pins or scores change
        # Every shipped policy scores (layer, expert) from that layer's routing history only, so a
        # score changes only when its layer is observed (or the key forgotten): cache per layer.
        self._scores: dict[int, dict[ExpertKey, tuple]] = {}
        self._by_layer: dict[int, dict[ExpertKey, _Entry]] = {}
        self._layer_order: dict[int, list[tuple[tuple, int, _Entry]]] = {}  # layer -> its entries by (score, seq)
        self._inserted = itertools.count()

    def resident(self) -> frozenset[ExpertKey]:
        """Resident or being copied (queued prefetches excluded), like OffloadedExperts.resident()."""
        return frozenset(self.table)

    # -- route-ahead prefetch --
    def prefetch_launch(self, unions: Sequence[Iterable[ExpertKey]], now: float) -> list[SimClaim]:
        """One claim per verify of one batched forward, numbered alike, and the missing keys
        wanted, as OffloadedExperts.prefetch_launch does; the claims are for `pass_layer` and
        `release`."""
        order = next(self._claim_orders)
        claims = [SimClaim(tuple(sorted(set(union))), order) for union in unions]
        for claim in claims:
            add_claims(self.claims, claim.keys, order)
            for key in claim.keys:
                if key not in self.table:
                    use = self.next_use(key)
                    assert use is not None
                    self.wanted.add(key, Priority.ROUTE_AHEAD, now, use)
        self._changed()
        return claims

    def pass_layer(self, layer: int, claims: Iterable[SimClaim]) -> None:
        """The verify of `claims` has computed `layer`: their claims there step back (forward_of)."""
        if self.claims_per_layer:
            return
        for claim in claims:
            if layer not in claim.passed:
                claim.passed.add(layer)
                pass_claims(self.claims, [k for k in claim.keys if k[0] == layer], claim.order)
        self._changed()

    def release(self, claim: SimClaim) -> None:
        """Give back one prefetch's claims (per-layer claims ended when the forward reached them)."""
        if self.claims_per_layer:
            return
        drop_claims(self.claims, [k for k in claim.keys if k[0] not in claim.passed], claim.order)
        drop_claims(self.claims, [k for k in claim.keys if k[0] in claim.passed], claim.order + PASSED)
        self._changed()

    # -- a forward's layer --
    def acquire(self, layer: int, experts: Iterable[int], now: float) -> tuple[list[_Entry], float]:
        """Pin the layer's routed experts (reserving and fetching the missing ones on demand);
        returns the pinned entries and the virtual time the last of them lands."""
        experts = sorted(set(experts))
        self.policy.observe(layer, experts)
        self._scores.pop(layer, None)
        self._layer_order.pop(layer, None)
        self._lane_victims = None
        if self.claims_per_layer:
            for key in [k for k in self.claims if k[0] == layer]:
                del self.claims[key]
            self._parked = False
        self._run_lane(until=now)
        held, missing = [], []
        for expert in experts:
            entry = self.table.get((layer, expert))
            if entry is None:
                missing.append((layer, expert))
                continue
            entry.pins += 1
            self.counters.hit_bytes += entry.nbytes
            entry.prefetched = False
            held.append(entry)
        if missing:
            victims = self._victims(len(missing) - self._free(), needed_at=None, now=now)
            if self._free() + len(victims) < len(missing):
                raise SimulationError(
                    f"layer {layer} routes {len(experts)} experts but only {self._free() + len(victims)} of the "
                    f"cache's {self.slots} slots can be freed; give the cache more bytes"
                )
            for victim in victims[: len(missing) - self._free()]:
                self._evict(victim)
            for key in missing:
                entry = self._add(_Entry(key, self.byte_map[key], pins=1))
                self.counters.miss_bytes += entry.nbytes
                self._queue.append(_Job(key, now, entry))
                held.append(entry)
        self._run_lane(until=now, needed=held)
        return held, max((e.ready_at for e in held), default=now)

    def unpin(self, held: list[_Entry]) -> None:
        for entry in held:
            entry.pins -= 1
        self._changed()

    def next_use(self, key: ExpertKey) -> NextUse | None:
        return next_use(self.claims, key)

    # -- internals --
    def _free(self) -> int:
        return self.slots - len(self.table)

    def _changed(self) -> None:
        """Pins or claims changed: victims are chosen anew, and a waiting key may find a slot."""
        self._lane_victims = None
        self._parked = False

    def _victims(self, n: int, *, needed_at: NextUse | None, now: float) -> list[_Entry]:
        """The n entries the real cache (SlotTable.victim) would evict one after another (scores
        do not change between): unclaimed by score, then claimed ones needed after `needed_at`
        (any, if None), the one needed last first."""
        if n <= 0:
            return []
        claimed: list[tuple[NextUse, _Entry]] = []  # the last resort
        chosen: list[_Entry] = []
        for _, _, e in heapq.merge(*(self._ordered(layer) for layer in self._by_layer)):
            if e.ready_at > now or e.pins:
                continue
            use = self.next_use(e.key)
            if use is None:
                chosen.append(e)
                if len(chosen) == n:
                    return chosen
            elif needed_at is None or use > needed_at:
                claimed.append((use, e))
        claimed.sort(key=lambda c: (-c[0][0], -c[0][1], c[1].seq))
        return chosen + [e for _, e in claimed[: n - len(chosen)]]

    def _ordered(self, layer: int) -> list[tuple[tuple, int, _Entry]]:
        """The layer's entries by (score, insertion): kept until the layer is observed or changes."""
        order = self._layer_order.get(layer)
        if order is None:
            entries = self._by_layer[layer].values()
            order = self._layer_order[layer] = sorted((self._score(e.key), e.seq, e) for e in entries)
        return order

    def _add(self, entry: _Entry) -> _Entry:
        entry.seq = next(self._inserted)
        self.table[entry.key] = entry
        self._by_layer.setdefault(entry.key[0], {})[entry.key] = entry
        self._layer_order.pop(entry.key[0], None)
        return entry

    def _score(self, key: ExpertKey) -> tuple:
        layer = self._scores.setdefault(key[0], {})
        if key not in layer:
            layer[key] = self.policy.score(key)
        return layer[key]

    def _evict(self, entry: _Entry) -> None:
        del self.table[entry.key]
        del self._by_layer[entry.key[0]][entry.key]
        self._layer_order.pop(entry.key[0], None)
        self.policy.forget(entry.key)
        self._scores.get(entry.key[0], {}).pop(entry.key, None)
        self.counters.evictions += 1
        if entry.prefetched:
            self.counters.prefetch_waste_bytes += entry.nbytes

    def _prefetch_slot(self, now: float, needed_at: NextUse) -> bool:
        if self._free() > 0:
            return True
        if self._lane_victims is None:  # the unclaimed ones first, in the order they go (until pins or claims change)
            self._lane_victims = self._victims(len(self.wanted.keys), needed_at=_NEVER, now=now)[::-1]
        while self._lane_victims:
            victim = self._lane_victims.pop()
            if self.table.get(victim.key) is victim and victim.key not in self.claims and victim.pins == 0:
                self._evict(victim)
                return True
        victims = self._victims(1, needed_at=needed_at, now=now)  # a claimed one needed after this key
        if victims:
            self._evict(victims[0])
        return bool(victims)

    def _soonest_wanted(self) -> tuple[ExpertKey, NextUse] | None:
        dropped = self.wanted.dropped
        soonest = self.wanted.soonest(self.next_use, self.table)
        self.counters.prefetch_dropped += self.wanted.dropped - dropped
        return soonest

    def _run_lane(self, *, until: float, needed: list[_Entry] | None = None) -> None:
        """Run copies, on-demand first, else the wanted key needed soonest: those that start by
        `until`, or until `needed` are all scheduled."""
        while True:
            if needed is not None and all(e.ready_at < math.inf for e in needed):
                return
            if self._queue:
                start = max(self._link_free_at, self._queue[0].requested_at)
                if needed is None and start > until:
                    return
                entry = self._queue.popleft().reserved
            else:
                soonest = None if self._parked else self._soonest_wanted()
                if soonest is None:
                    return
                key, use = soonest
                start = max(self._link_free_at, self.wanted.keys[key][1])
                if needed is None and start > until:
                    return
                if not self._prefetch_slot(start, use):
                    if self.claims_per_layer:  # that cache dropped what it could not fit
                        self.counters.prefetch_dropped += 1
                        self.wanted.take(key)
                    else:
                        self._parked = True  # until pins or claims change
                    continue
                self.wanted.take(key)
                entry = self._add(_Entry(key, self.byte_map[key], prefetched=True))
                self.counters.prefetch_bytes += entry.nbytes
            entry.ready_at = self._link_free_at = start + entry.nbytes / self.rate
            self.counters.link_busy_s += entry.nbytes / self.rate
            self.counters.expert_bytes_fetched += entry.nbytes
            self.counters.fetches += 1
