"""The device expert cache: a byte-budgeted slot arena that serves MoE layers their experts in waves.

Owns which expert sits in which slot of the arena (`arena.SlotArena`: the tensors and the
copies), pins, claims, eviction, on-demand and prefetch requests to the lane, and the
offload counters. Implements the `ExpertProvider` protocol (`waves`) and `resident()` (the
speculator's fetch_bytes). It must not touch model math (the model) or the file format
(HostExpertStore).

Bytes. Budgets, slots and `expert_cache_peak_bytes` are device bytes in the compute dtype
(what the arena occupies). Fetched, hit, miss, prefetch and waste bytes are byte-map bytes:
payload bytes as stored in the checkpoint, the same figures `DraftResult.fetch_bytes` and the
scheduler use, and what the emulated link charges. They differ only when the compute dtype
differs from the stored one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from pdflash.measure import BusyClock
from pdflash.offload.arena import SlotArena
from pdflash.offload.cache_stats import Counters, OffloadStats
from pdflash.offload.eviction import make_policy
from pdflash.offload.gpt_oss_store import GptOssHostExpertStore
from pdflash.offload.host_store import HostExpertStore
from pdflash.offload.link import Link, measure_bytes_per_s
from pdflash.offload.prefetch import PrefetchLane, Priority
from pdflash.offload.slot_table import (
    PASSED,
    Entry,
    EntryState,
    NextUse,
    ResidentKeys,
    SlotTable,
    WantedKeys,
    pass_claims,
)
from pdflash.target.config import ModelConfig
from pdflash.target.experts import ExpertKey
from pdflash.target.gpt_oss_config import GptOssConfig

LINK_SAMPLE_EXPERTS = 8  # experts copied once at start to measure a real link (after one warm-up copy)


class ExpertFetchError(RuntimeError):
    """An expert a forward needed could not be fetched (names the expert; the cause is chained)."""


@attrs.define(eq=False)
class ExpertClaim:
    """What one route-ahead prefetch asked the cache to keep: its keys stay claimed (no prefetch
    for a later need evicts them); once its forward has passed their layer (`forward_of`) they
    are needed after every claim ahead, until `OffloadedExperts.release(claim)`, once the
    verify that needs them ran."""

    keys: tuple[ExpertKey, ...]  # every key of the prefetched union, resident or queued
    queued: int  # keys not resident when asked: fetches queued on the lane
    order: int  # claims are numbered as they come, the order their forwards run in (one per launch)
    passed: set[int] = attrs.Factory(set)  # layers its forward has computed (their keys at order + PASSED)
    released: bool = False  # given back (set by release, under the cache's lock)


class OffloadedExperts:
    """An ExpertProvider over a host store and a byte-budgeted device arena, fed by a prefetch lane."""

    def __init__(
        self,
        store: HostExpertStore | GptOssHostExpertStore,
        config: ModelConfig | GptOssConfig,
        *,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        expert_cache_bytes: int | None = None,
        expert_cache_fraction: float | None = None,
        policy: str = "activation",
        link_gbps: float | None = None,
        link_latency_s: float = 0.0,
    ) -> None:
        self.store = store
        self.device = torch.device(device)
        self.num_experts = config.num_experts
        self.arena = SlotArena(
            store,
            dtype=dtype,
            device=self.device,
            expert_cache_bytes=expert_cache_bytes,
            expert_cache_fraction=expert_cache_fraction,
        )
        self.budget_bytes, self.num_slots = self.arena.budget_bytes, self.arena.num_slots
        self.policy = make_policy(policy)
        self.link = Link.for_device(self.device, gbps=link_gbps, latency_s=link_latency_s)
        self._cond = threading.Condition()  # guards everything below, the policy and the counters
        self._slots = SlotTable(self.num_slots, self.num_experts)
        # CUDA: slot -> compute stream -> the last event after which that stream is done with the slot
        # (one per stream, not one per unpin: an expert that is never evicted would gather events forever)
        self._readers: dict[int, dict[torch.cuda.Stream, torch.cuda.Event]] = {}
        self._counters = Counters()
        self._closed = False
        self._claim_orders = itertools.count()
        self._wanted = WantedKeys()  # claimed, not resident: fetched one at a time, the soonest needed first
        self._fetch_queued = False  # a `_fetch_next` job is on the lane
        self._forward = threading.local()  # .claims: those of the forward running on this thread
        self.lane = PrefetchLane(self.device)
        if self.link.label == "device":
            self.link.measured_bytes_per_s = self._measure_link()

    # -- the ExpertProvider protocol ---------------------------------------------------------
    def waves(self, layer: int, union: list[int]) -> Iterator[Any]:
        """Waves covering `union`: what is resident first, the rest as the lane lands it and slots free up."""
        pending = list(dict.fromkeys(union))
        held: list[Entry] = []  # pinned by this call, not yet computed
        with self._cond:
            self.policy.observe(layer, pending)
        try:
            while pending or held:
                wave = self._next_wave(layer, pending, held)
                if self.device.type == "cuda":
                    stream = torch.cuda.current_stream(self.device)
                    for entry in wave:
                        if entry.loaded is not None:
                            stream.wait_event(entry.loaded)
                yield self._as_wave(wave)
                with self._cond:
                    self._unpin(wave)
                held = [e for e in held if e not in wave]
        finally:
            with self._cond:
                self._unpin(held)
                self._pass(layer)

    def resident(self) -> ResidentKeys:
        """Keys resident in the arena or being copied into it now (queued prefetches excluded),
        with their bitmask, which a tick reads as one int (`slot_table.ResidentKeys`)."""
        with self._cond:
            return self._slots.resident()

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, union: Iterable[ExpertKey], priority: Priority = Priority.ROUTE_AHEAD) -> ExpertClaim:
        """Claim every key of `union` and queue fetches of those not resident (one verify's
        prefetch: `prefetch_launch` of one union)."""
        return self.prefetch_launch([union], priority)[0]

    def prefetch_launch(
        self, unions: Sequence[Iterable[ExpertKey]], priority: Priority = Priority.ROUTE_AHEAD
    ) -> list[ExpertClaim]:
        """One claim per verify of one batched forward, each on every key of its union, and
        fetches queued for the keys not resident.

        The claims share one number: the forward computes every verify's layer l before any
        verify's layer l + 1, so a key's need is (that number, its layer) whichever verify asked
        for it. The lane fetches queued keys one at a time, the one a claimed forward needs
        soonest first, each into a slot whose expert is unclaimed or needed later; when there is
        none, the key waits until a forward moves on or a claim ends. Claimed keys are not
        evicted for a later need (a forward's own misses still may evict them, those needed last
        first), so the verify that asked finds them.
        """
        if priority is Priority.ON_DEMAND:
            raise ValueError("prefetch priority must be ROUTE_AHEAD or BACKGROUND; ON_DEMAND is a forward's own")
        asked = [tuple(sorted(set(union))) for union in unions]
        unknown = [k for keys in asked for k in keys if k not in self.store]
        if unknown:
            raise ValueError(
                f"prefetch of unknown experts {unknown[:5]}; keys are (MoE layer, expert < {self.num_experts})"
            )
        with self._cond:
            order = next(self._claim_orders)
            claims = [ExpertClaim(keys=keys, queued=0, order=order) for keys in asked]
            for claim in claims:
                self._slots.claim(claim.keys, order)
                for key in claim.keys:
                    if key not in self._slots.entries:
                        use = self._slots.next_use(key)
                        assert use is not None
                        self._wanted.add(key, priority, time.perf_counter(), use)
                        claim.queued += 1
                self._counters.prefetch_requests += claim.queued
            self._kick()
        return claims

    def release(self, claim: ExpertClaim) -> None:
        """Give back a prefetch's claims (its verify ran, or its sequence left); idempotent per claim."""
        with self._cond:
            if claim.released:
                return
            claim.released = True
            self._slots.unclaim([k for k in claim.keys if k[0] not in claim.passed], claim.order)
            self._slots.unclaim([k for k in claim.keys if k[0] in claim.passed], claim.order + PASSED)
            self._kick()
            self._cond.notify_all()

    @contextlib.contextmanager
    def forward_of(self, claims: Iterable[ExpertClaim]) -> Iterator[None]:
        """Inside, the forward run on this thread is the verify of `claims`: as it leaves each
        layer, their keys of that layer are needed after every claim ahead (slot_table.PASSED),
        so fetches for what comes next may take those slots."""
        self._forward.claims = tuple(claims)
        try:
            yield
        finally:
            self._forward.claims = ()

    # -- stats ---------------------------------------------------------------------------------
    @property
    def link_bytes_per_s(self) -> float | None:
        """The link's rate (emulated, or a real one's as measured at start); None without one."""
        return self.link.bytes_per_s

    @property
    def exposed_fetch_s(self) -> float:
        """Seconds forwards have waited on expert copies so far: the one figure the pacer reads
        around every verify, so read alone (a whole `snapshot` cost 40 µs a read there)."""
        with self._cond:
            return self._counters.exposed_fetch_s

    def _measure_link(self, experts: int = LINK_SAMPLE_EXPERTS) -> float | None:
        """A real (CUDA) link's rate in byte-map bytes per second: the first experts of the store
        copied into free slots on the lane's stream, as fetches copy them (the slots stay free)."""
        hosts: list[Any] = []  # HostExpert or GptOssHostExpert
        nbytes: list[int] = []
        for key in self.store.keys:  # checked and mapped outside the timing
            if len(hosts) > min(experts, self.num_slots):
                break
            try:
                hosts.append(self.store.expert(key))
            except Exception:  # a corrupt expert fails the forward that needs it, not the cache
                continue
            nbytes.append(self.store.nbytes(key))
        with torch.cuda.stream(self.lane.stream):
            return measure_bytes_per_s(
                [functools.partial(self.arena.copy_in, i % self.num_slots, host) for i, host in enumerate(hosts)],
                nbytes,
                functools.partial(torch.cuda.synchronize, self.device),
            )

    def watch_busy(self, clock: BusyClock) -> None:
        """Count the time the prefetch lane runs jobs (fetches) into `clock` too."""
        self.lane.busy = clock

    def copy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) perf_counter seconds of the prefetch lane's recent jobs (fetches)."""
        return list(self.lane.intervals)

    def snapshot(self) -> OffloadStats:
        with self._cond:
            return OffloadStats.of(
                self._counters,
                link=self.link.label,
                link_bytes_per_s=self.link.bytes_per_s,
                policy=self.policy.name,
                budget_bytes=self.budget_bytes,
                num_slots=self.num_slots,
                slot_bytes=self.arena.slot_bytes,
                claimed_experts=len(self._slots.claims),
            )

    def stats(self) -> dict:
        return self.snapshot().as_dict()

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from what is occupied now."""
        with self._cond:
            self._counters = Counters(peak_slots=self._slots.occupied)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the lane; queued fetches are dropped and forwards waiting on them fail."""
        with self._cond:
            self._closed = True
        self.lane.close()
        with self._cond:
            for entry in [e for e in self._slots.entries.values() if e.state is EntryState.LOADING]:
                self._fail(entry, RuntimeError("the offloaded expert provider was closed"))

    def __enter__(self) -> OffloadedExperts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forward side (called by waves) --------------------------------------------------------
    def _next_wave(self, layer: int, pending: list[int], held: list[Entry]) -> list[Entry]:
        """Pin what is resident, reserve slots for what fits, and wait until some of `held` is ready."""
        with self._cond:
            self._acquire(layer, pending, held)
            started = time.perf_counter()
            while True:
                failed = next((e for e in held if e.state is EntryState.FAILED), None)
                if failed is not None:
                    raise ExpertFetchError(
                        f"this forward needs expert (layer {failed.key[0]}, expert {failed.key[1]}), and fetching it "
                        f"failed: {failed.error}"
                    ) from failed.error
                ready = [e for e in held if e.state is EntryState.READY]
                if ready:
                    break
                if self._closed:
                    raise RuntimeError("the offloaded expert provider is closed")
                self._cond.wait()
                if not held:  # every slot was pinned by other forwards: try again now one was released
                    self._acquire(layer, pending, held)
            self._counters.exposed_fetch_s += time.perf_counter() - started
            return ready

    def _acquire(self, layer: int, pending: list[int], held: list[Entry]) -> None:
        missing = []
        for expert in pending:
            entry = self._slots.entries.get((layer, expert))
            if entry is None:
                missing.append(expert)
                continue
            entry.pins += 1
            self._counters.hits += 1
            self._counters.hit_bytes += entry.nbytes
            if entry.prefetched:
                entry.prefetched = False
                self._counters.prefetch_hits += 1
                self._counters.prefetch_hit_bytes += entry.nbytes
            held.append(entry)
        reserved: list[Entry] = []
        requested_at = time.perf_counter()
        for expert in missing:
            slot = None if self._closed else self._take_slot(needed_at=None)
            if slot is None:
                break
            key = (layer, expert)
            entry = Entry(key=key, slot=slot, nbytes=self.store.nbytes(key), requested_at=requested_at, pins=1)
            self._slots.add(entry)
            self._counters.misses += 1
            self._counters.miss_bytes += entry.nbytes
            reserved.append(entry)
        if reserved:  # one lane job per wave of misses: each lands (and is usable) on its own
            self.lane.submit(Priority.ON_DEMAND, lambda: self._load_all(reserved))
        held += reserved
        pending[:] = missing[len(reserved) :]

    def _pass(self, layer: int) -> None:
        """The forward on this thread has computed `layer`: its claims there step back."""
        for claim in getattr(self._forward, "claims", ()):
            if not claim.released and layer not in claim.passed:
                claim.passed.add(layer)
                pass_claims(self._slots.claims, [k for k in claim.keys if k[0] == layer], claim.order)
        self._kick()

    def _unpin(self, entries: list[Entry]) -> None:
        for entry in entries:
            entry.pins -= 1
            if self.device.type == "cuda" and entry.state is EntryState.READY:
                stream = torch.cuda.current_stream(self.device)
                done = torch.cuda.Event()
                done.record(stream)
                self._readers.setdefault(entry.slot, {})[stream] = done
        self._kick()
        self._cond.notify_all()

    def _as_wave(self, entries: list[Entry]) -> Any:
        return self.arena.wave(self.num_experts, [e.key[1] for e in entries], [e.slot for e in entries])

    # -- slots (under the lock) ----------------------------------------------------------------
    def _take_slot(self, *, needed_at: NextUse | None) -> int | None:
        """A free slot, else one freed by evicting the table's choice among unpinned ready experts
        (for a fetch `needed_at` a claimed forward's (order, layer): only those needed later)."""
        slot = self._slots.take_free()
        if slot is None:
            victim = self._slots.victim(self.policy.score, needed_at=needed_at)
            if victim is None:
                return None
            self._forget(victim)
            self._counters.evictions += 1
            if victim.prefetched:
                self._counters.prefetch_waste_bytes += victim.nbytes
            slot = self._slots.take_free()
        self._counters.peak_slots = max(self._counters.peak_slots, self._slots.occupied)
        return slot

    def _forget(self, entry: Entry) -> None:
        self._slots.remove(entry)
        self.policy.forget(entry.key)

    def _fail(self, entry: Entry, error: Exception) -> None:
        entry.state, entry.error = EntryState.FAILED, error
        self._forget(entry)
        self._counters.fetch_errors += 1
        self._cond.notify_all()

    # -- lane side (runs on the prefetch lane's thread) ----------------------------------------
    def _kick(self) -> None:
        """Under the lock: put a `_fetch_next` on the lane if keys wait and none is there."""
        if self._wanted.keys and not self._fetch_queued and not self._closed:
            self._fetch_queued = True
            self.lane.submit(Priority.ROUTE_AHEAD, self._fetch_next)  # after on-demand copies; it picks by priority

    def _fetch_next(self) -> None:
        """Fetch the wanted key needed soonest, if a slot can be had for it; then the next."""
        with self._cond:
            self._fetch_queued = False
            entry = None if self._closed else self._reserve_wanted()
        if entry is not None and self._load(entry):
            with self._cond:
                self._counters.prefetch_fetches += 1
                self._counters.prefetch_bytes += entry.nbytes
        with self._cond:
            if entry is not None:
                self._kick()

    def _reserve_wanted(self) -> Entry | None:
        """Under the lock: a slot reserved for the wanted key needed soonest; None when no slot
        can be freed for it (a forward moving on or a claim ending kicks the lane again)."""
        dropped = self._wanted.dropped
        soonest = self._wanted.soonest(self._slots.next_use, self._slots.entries)
        self._counters.prefetch_dropped += self._wanted.dropped - dropped  # claims ended before a slot was had
        if soonest is None:
            return None
        key, use = soonest
        slot = self._take_slot(needed_at=use)
        if slot is None:
            return None
        self._wanted.take(key)
        entry = Entry(
            key=key, slot=slot, nbytes=self.store.nbytes(key), requested_at=time.perf_counter(), prefetched=True
        )
        self._slots.add(entry)
        return entry

    def _load_all(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._load(entry)

    def _load(self, entry: Entry) -> bool:
        """Copy `entry`'s expert into its slot over the link; on failure free the slot and report it."""
        started = time.perf_counter()
        try:
            host = self.store.expert(entry.key)
            entry.loaded = self.arena.copy_in(entry.slot, host, after=self._readers_of(entry.slot))
            self.link.transfer(host.nbytes, requested_at=entry.requested_at)
        except Exception as exc:
            with self._cond:
                self._counters.link_busy_s += time.perf_counter() - started
                self._fail(entry, exc)
            return False
        with self._cond:
            self._counters.link_busy_s += time.perf_counter() - started
            entry.state = EntryState.READY
            self._counters.fetches += 1
            self._counters.expert_bytes_fetched += entry.nbytes
            self._cond.notify_all()
        return True

    def _readers_of(self, slot: int) -> list[torch.cuda.Event]:
        """CUDA: events after which the forwards that read `slot`'s previous expert are done with it."""
        if self.device.type != "cuda":
            return []
        with self._cond:
            return list(self._readers.pop(slot, {}).values())
