"""The simulated device expert cache and its serial copy engine, on a virtual clock.

Mirrors `pdflash.offload.device_cache` without tensors or threads: a table of experts in
slots, pins held by the layer a forward is running, counted claims held by route-ahead
prefetches until their verify ran (`release`), and the REAL eviction policy (`make_policy`) choosing
among unpinned ready experts (claimed last, then lowest score). One serial copy engine runs
jobs in priority order (on-demand > route-ahead), each taking bytes / link rate, like the
emulated link's pipe. Counts in the real cache's `Counters`. Must not schedule or compute.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping

import attrs

from pdflash.offload.cache_stats import Counters
from pdflash.offload.eviction import make_policy
from pdflash.offload.prefetch import Priority
from pdflash.offload.slot_table import drop_claims
from pdflash.target.experts import ExpertKey


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
    reserved: _Entry | None  # on-demand: the forward reserved its slot already


class SimCache:
    """Slots, pins, claims, the eviction policy and the copy engine of one simulated run."""

    def __init__(
        self,
        byte_map: Mapping[ExpertKey, int],
        *,
        slots: int,
        link_bytes_per_s: float,
        policy: str,
        claims_per_layer: bool = False,  # the cache before 83fdf42: a forward reaching a layer ends its claims
    ) -> None:
        if slots < 2:
            raise SimulationError(f"the simulated expert cache holds {slots} experts; it needs at least 2")
        self.byte_map, self.slots, self.rate = byte_map, slots, link_bytes_per_s
        self.policy = make_policy(policy)
        self.table: dict[ExpertKey, _Entry] = {}
        self.counters = Counters()  # the real cache's counters (the subset a simulation moves)
        self._queue: list[tuple[int, int, _Job]] = []
        self._order = itertools.count()
        self._link_free_at = 0.0
        self.claims: dict[ExpertKey, int] = {}  # key -> unreleased prefetches claiming it
        self.claims_per_layer = claims_per_layer
        self._lane_victims: list[_Entry] | None = None  # valid until pins or scores change
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
    def prefetch(self, union: Iterable[ExpertKey], now: float) -> tuple[ExpertKey, ...]:
        """Queue the union's missing experts (earliest layer first) and claim every key of it, as
        OffloadedExperts.prefetch does; returns the claim, for `release` once its verify ran."""
        keys = tuple(sorted(set(union)))
        for key in keys:
            self.claims[key] = self.claims.get(key, 0) + 1
            if key not in self.table:
                self._push(Priority.ROUTE_AHEAD, _Job(key, now, None))
        self._lane_victims = None
        return keys

    def release(self, claim: tuple[ExpertKey, ...]) -> None:
        """Give back one prefetch's claims (per-layer claims ended when the forward reached them)."""
        if self.claims_per_layer:
            return
        drop_claims(self.claims, claim)
        self._lane_victims = None

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
            victims = self._victims(len(missing) - self._free(), allow_claimed=True, now=now)
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
                self._push(Priority.ON_DEMAND, _Job(key, now, entry))
                held.append(entry)
        self._run_lane(until=now, needed=held)
        return held, max((e.ready_at for e in held), default=now)

    def unpin(self, held: list[_Entry]) -> None:
        for entry in held:
            entry.pins -= 1
        self._lane_victims = None

    # -- internals --
    def _free(self) -> int:
        return self.slots - len(self.table)

    def _push(self, priority: Priority, job: _Job) -> None:
        heapq.heappush(self._queue, (int(priority), next(self._order), job))

    def _victims(self, n: int, *, allow_claimed: bool, now: float) -> list[_Entry]:
        """The n entries the real cache would evict one after another (scores do not change between)."""
        if n <= 0:
            return []
        claims = self.claims
        chosen: list[_Entry] = []
        claimed: list[_Entry] = []  # the last resort, in the same order
        for _, _, e in heapq.merge(*(self._ordered(layer) for layer in self._by_layer)):
            if e.ready_at > now or e.pins:
                continue
            if e.key in claims:
                if allow_claimed and len(claimed) < n:
                    claimed.append(e)
                continue
            chosen.append(e)
            if len(chosen) == n:
                return chosen
        return chosen + claimed[: n - len(chosen)]

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

    def _prefetch_slot(self, now: float) -> bool:
        if self._free() > 0:
            return True
        if self._lane_victims is None:
            self._lane_victims = self._victims(len(self._queue) + 1, allow_claimed=False, now=now)[::-1]
        while self._lane_victims:
            victim = self._lane_victims.pop()
            if self.table.get(victim.key) is victim and victim.key not in self.claims and victim.pins == 0:
                self._evict(victim)
                return True
        return False

    def _run_lane(self, *, until: float, needed: list[_Entry] | None = None) -> None:
        """Run copy jobs in priority order: those that start by `until`, or until `needed` are all scheduled."""
        while self._queue:
            if needed is not None:
                if all(e.ready_at < math.inf for e in needed):
                    return
            elif max(self._link_free_at, self._queue[0][2].requested_at) > until:
                return
            priority, _, job = heapq.heappop(self._queue)
            start = max(self._link_free_at, job.requested_at)
            entry = job.reserved
            if entry is None:  # route-ahead: like the lane's _prefetch_job
                if job.key in self.table:  # claimed at prefetch; another copy brought it
                    continue
                if not self._prefetch_slot(start):
                    self.counters.prefetch_dropped += 1
                    continue
                entry = self._add(_Entry(job.key, self.byte_map[job.key], prefetched=True))
                self.counters.prefetch_bytes += entry.nbytes
            entry.ready_at = self._link_free_at = start + entry.nbytes / self.rate
            self.counters.link_busy_s += entry.nbytes / self.rate
            self.counters.expert_bytes_fetched += entry.nbytes
            self.counters.fetches += 1
