"""The device expert cache: a byte-budgeted slot arena that serves MoE layers their experts in waves.

Owns the arena (one expert per slot, laid out as the store's `slot_layout` says: Qwen3's
gate/up/down in the compute dtype, gpt-oss's MXFP4 blocks and scales as stored), which expert sits in
which slot, pins, eviction, on-demand and prefetch requests to the lane, and the offload
stats. Implements the `ExpertProvider` protocol (`waves`) and `resident()` (the speculator's
fetch_bytes). It must not touch model math (the model) or the file format (HostExpertStore).

Bytes. Budgets, slots and `expert_cache_peak_bytes` are device bytes in the compute dtype
(what the arena occupies). Fetched, hit, miss, prefetch and waste bytes are byte-map bytes:
payload bytes as stored in the checkpoint, the same figures `DraftResult.fetch_bytes` and the
scheduler use, and what the emulated link charges. They differ only when the compute dtype
differs from the stored one.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch

from pdflash.kernels.mxfp4 import payload_nbytes
from pdflash.offload.cache_stats import Counters, OffloadStats, ratio
from pdflash.offload.eviction import make_policy
from pdflash.offload.gpt_oss_store import GptOssHostExpert, GptOssHostExpertStore
from pdflash.offload.host_store import HostExpert, HostExpertStore
from pdflash.offload.link import Link
from pdflash.offload.prefetch import PrefetchLane, Priority
from pdflash.target.config import ModelConfig
from pdflash.target.experts import ExpertKey
from pdflash.target.gpt_oss_config import GptOssConfig

MIN_SLOTS = 2  # one expert being computed while the next one lands


class ExpertFetchError(RuntimeError):
    """An expert a forward needed could not be fetched (names the expert; the cause is chained)."""


class EntryState(enum.Enum):
    LOADING = "loading"  # slot reserved, the lane is (or will be) copying into it
    READY = "ready"
    FAILED = "failed"  # the fetch raised; the entry already left the table and gave its slot back


@attrs.define(eq=False)
class _Entry:
    key: ExpertKey
    slot: int
    nbytes: int  # byte-map bytes (as stored)
    requested_at: float  # perf_counter time the fetch was asked for (the emulated link's queueing)
    state: EntryState = EntryState.LOADING
    pins: int = 0  # waves holding it: never evicted while > 0
    prefetched: bool = False  # brought in by a prefetch and not yet used by a forward
    loaded: torch.cuda.Event | None = None  # CUDA: the lane's copy into the slot is done
    error: Exception | None = None


@attrs.define(eq=False)
class ExpertClaim:
    """What one route-ahead prefetch asked the cache to keep: its keys stay claimed (no prefetch
    evicts them) until `OffloadedExperts.release(claim)`, once the verify that needs them ran."""

    keys: tuple[ExpertKey, ...]  # every key of the prefetched union, resident or queued
    queued: int  # keys not resident when asked: fetches queued on the lane
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
        layout = store.slot_layout(dtype)  # name -> (shape, dtype) of one slot's tensors
        self.slot_bytes = payload_nbytes(*layout.values())
        self.budget_bytes = _budget_bytes(expert_cache_bytes, expert_cache_fraction, len(store.keys) * self.slot_bytes)
        self.num_slots = min(self.budget_bytes // self.slot_bytes, len(store.keys))
        if self.num_slots < MIN_SLOTS:
            raise ValueError(
                f"expert cache budget of {self.budget_bytes} bytes holds {self.num_slots} expert(s) of "
                f"{self.slot_bytes} bytes ({dtype}); the minimum is {MIN_SLOTS} experts = "
                f"{MIN_SLOTS * self.slot_bytes} bytes"
            )
        self.policy = make_policy(policy)
        self.link = Link.for_device(self.device, gbps=link_gbps, latency_s=link_latency_s)
        self.arena = {  # name -> [S, ...]: Qwen3 gate/up/down; gpt-oss MXFP4 blocks, scales, biases
            name: torch.empty((self.num_slots, *shape), dtype=slot_dtype, device=self.device)
            for name, (shape, slot_dtype) in layout.items()
        }
        S = self.num_slots
        self._cond = threading.Condition()  # guards everything below, the policy and the counters
        self._table: dict[ExpertKey, _Entry] = {}
        self._free = list(range(S - 1, -1, -1))
        self._claims: dict[ExpertKey, int] = {}  # key -> unreleased claims on it
        # CUDA: slot -> compute stream -> the last event after which that stream is done with the slot
        # (one per stream, not one per unpin: an expert that is never evicted would gather events forever)
        self._readers: dict[int, dict[torch.cuda.Stream, torch.cuda.Event]] = {}
        self._counters = Counters()
        self._closed = False
        self.lane = PrefetchLane(self.device)

    # -- the ExpertProvider protocol ---------------------------------------------------------
    def waves(self, layer: int, union: list[int]) -> Iterator[Any]:
        """Waves covering `union`: what is resident first, the rest as the lane lands it and slots free up."""
        pending = list(dict.fromkeys(union))
        held: list[_Entry] = []  # pinned by this call, not yet computed
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

    def resident(self) -> frozenset[ExpertKey]:
        """Keys resident in the arena or being copied into it now (queued prefetches excluded)."""
        with self._cond:
            return frozenset(self._table)

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, union: Iterable[ExpertKey], priority: Priority = Priority.ROUTE_AHEAD) -> ExpertClaim:
        """Queue fetches of the keys of `union` not resident, earliest layer first, and claim them all.

        Claimed keys are not evicted by any prefetch until `release(claim)` (a forward's own
        misses still may evict them, last among candidates), so the verify that asked finds them.
        """
        if priority is Priority.ON_DEMAND:
            raise ValueError("prefetch priority must be ROUTE_AHEAD or BACKGROUND; ON_DEMAND is a forward's own")
        keys = tuple(sorted(set(union)))
        unknown = [k for k in keys if k not in self.store]
        if unknown:
            raise ValueError(
                f"prefetch of unknown experts {unknown[:5]}; keys are (MoE layer, expert < {self.num_experts})"
            )
        queued, requested_at = 0, time.perf_counter()
        with self._cond:
            for key in keys:
                self._claims[key] = self._claims.get(key, 0) + 1
                if key not in self._table:
                    self.lane.submit(priority, functools.partial(self._prefetch_job, key, requested_at))
                    queued += 1
            self._counters.prefetch_requests += queued
        return ExpertClaim(keys=keys, queued=queued)

    def release(self, claim: ExpertClaim) -> None:
        """Give back a prefetch's claims (its verify ran, or its sequence left); idempotent per claim."""
        with self._cond:
            if claim.released:
                return
            claim.released = True
            for key in claim.keys:
                left = self._claims.get(key, 0) - 1
                if left > 0:
                    self._claims[key] = left
                else:
                    self._claims.pop(key, None)
            self._cond.notify_all()

    # -- stats ---------------------------------------------------------------------------------
    @property
    def link_bytes_per_s(self) -> float | None:
        """The emulated link's rate; None for a real one (copies take what they take)."""
        return self.link.gbps * 1e9 if self.link.gbps is not None else None

    def copy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) perf_counter seconds of the prefetch lane's recent jobs (fetches)."""
        return list(self.lane.intervals)

    def snapshot(self) -> OffloadStats:
        with self._cond:
            c = self._counters
            return OffloadStats(
                link=self.link.label,
                policy=self.policy.name,
                expert_cache_bytes=self.budget_bytes,
                expert_cache_slots=self.num_slots,
                expert_slot_bytes=self.slot_bytes,
                expert_cache_peak_bytes=c.peak_slots * self.slot_bytes,
                expert_bytes_fetched=c.expert_bytes_fetched,
                fetches=c.fetches,
                hits=c.hits,
                misses=c.misses,
                hit_bytes=c.hit_bytes,
                miss_bytes=c.miss_bytes,
                expert_cache_hit_rate=ratio(c.hit_bytes, c.hit_bytes + c.miss_bytes),
                evictions=c.evictions,
                exposed_fetch_s=c.exposed_fetch_s,
                prefetch_requests=c.prefetch_requests,
                prefetch_fetches=c.prefetch_fetches,
                prefetch_bytes=c.prefetch_bytes,
                prefetch_dropped=c.prefetch_dropped,
                claimed_experts=len(self._claims),
                prefetch_coverage=ratio(c.prefetch_hit_bytes, c.prefetch_hit_bytes + c.miss_bytes),
                prefetch_waste_bytes=c.prefetch_waste_bytes,
                fetch_errors=c.fetch_errors,
            )

    def stats(self) -> dict:
        return self.snapshot().as_dict()

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from what is occupied now."""
        with self._cond:
            self._counters = Counters(peak_slots=self.num_slots - len(self._free))

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the lane; queued fetches are dropped and forwards waiting on them fail."""
        with self._cond:
            self._closed = True
        self.lane.close()
        with self._cond:
            for entry in [e for e in self._table.values() if e.state is EntryState.LOADING]:
                self._fail(entry, RuntimeError("the offloaded expert provider was closed"))

    def __enter__(self) -> OffloadedExperts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forward side (called by waves) --------------------------------------------------------
    def _next_wave(self, layer: int, pending: list[int], held: list[_Entry]) -> list[_Entry]:
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

    def _acquire(self, layer: int, pending: list[int], held: list[_Entry]) -> None:
        missing = []
        for expert in pending:
            entry = self._table.get((layer, expert))
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
        reserved: list[_Entry] = []
        requested_at = time.perf_counter()
        for expert in missing:
            slot = None if self._closed else self._take_slot(allow_claimed=True)
            if slot is None:
                break
            key = (layer, expert)
            entry = _Entry(key=key, slot=slot, nbytes=self.store.nbytes(key), requested_at=requested_at, pins=1)
            self._table[key] = entry
            self._counters.misses += 1
            self._counters.miss_bytes += entry.nbytes
            reserved.append(entry)
        if reserved:  # one lane job per wave of misses: each lands (and is usable) on its own
            self.lane.submit(Priority.ON_DEMAND, lambda: self._load_all(reserved))
        held += reserved
        pending[:] = missing[len(reserved) :]

    def _unpin(self, entries: list[_Entry]) -> None:
        for entry in entries:
            entry.pins -= 1
            if self.device.type == "cuda" and entry.state is EntryState.READY:
                stream = torch.cuda.current_stream(self.device)
                done = torch.cuda.Event()
                done.record(stream)
                self._readers.setdefault(entry.slot, {})[stream] = done
        self._cond.notify_all()

    def _as_wave(self, entries: list[_Entry]) -> Any:
        slot_of_expert = torch.full((self.num_experts,), -1, dtype=torch.int64)  # [E]
        slot_of_expert[[e.key[1] for e in entries]] = torch.tensor([e.slot for e in entries])
        return self.store.wave(slot_of_expert.to(self.device), self.arena)

    # -- slots (under the lock) ----------------------------------------------------------------
    def _take_slot(self, *, allow_claimed: bool) -> int | None:
        """A free slot, else one freed by evicting the policy's choice among unpinned ready experts."""
        if not self._free:
            candidates = [
                e
                for e in self._table.values()
                if e.state is EntryState.READY and e.pins == 0 and (allow_claimed or e.key not in self._claims)
            ]
            if not candidates:
                return None
            victim = min(candidates, key=lambda e: (e.key in self._claims, self.policy.score(e.key)))
            self._forget(victim)
            self._counters.evictions += 1
            if victim.prefetched:
                self._counters.prefetch_waste_bytes += victim.nbytes
        slot = self._free.pop()
        self._counters.peak_slots = max(self._counters.peak_slots, self.num_slots - len(self._free))
        return slot

    def _forget(self, entry: _Entry) -> None:
        del self._table[entry.key]
        self.policy.forget(entry.key)
        self._free.append(entry.slot)

    def _fail(self, entry: _Entry, error: Exception) -> None:
        entry.state, entry.error = EntryState.FAILED, error
        self._forget(entry)
        self._counters.fetch_errors += 1
        self._cond.notify_all()

    # -- lane side (runs on the prefetch lane's thread) ----------------------------------------
    def _prefetch_job(self, key: ExpertKey, requested_at: float) -> None:
        with self._cond:
            if self._closed:
                return
            if key in self._table:
                return
            slot = self._take_slot(allow_claimed=False)
            if slot is None:
                self._counters.prefetch_dropped += 1
                return
            entry = _Entry(
                key=key, slot=slot, nbytes=self.store.nbytes(key), requested_at=requested_at, prefetched=True
            )
            self._table[key] = entry
        if self._load(entry):
            with self._cond:
                self._counters.prefetch_fetches += 1
                self._counters.prefetch_bytes += entry.nbytes

    def _load_all(self, entries: list[_Entry]) -> None:
        for entry in entries:
            self._load(entry)

    def _load(self, entry: _Entry) -> bool:
        """Copy `entry`'s expert into its slot over the link; on failure free the slot and report it."""
        try:
            host = self.store.expert(entry.key)
            self._copy(entry, host)
            self.link.transfer(host.nbytes, requested_at=entry.requested_at)
        except Exception as exc:
            with self._cond:
                self._fail(entry, exc)
            return False
        with self._cond:
            entry.state = EntryState.READY
            self._counters.fetches += 1
            self._counters.expert_bytes_fetched += entry.nbytes
            self._cond.notify_all()
        return True

    def _copy(self, entry: _Entry, host: HostExpert | GptOssHostExpert) -> None:
        slot = entry.slot
        if self.device.type == "cuda":
            with self._cond:
                readers = self._readers.pop(slot, {})
            lane_stream = torch.cuda.current_stream(self.device)
            for done in readers.values():  # forwards that computed on the slot's previous expert
                lane_stream.wait_event(done)
        for name, tensor in host.tensors().items():
            slot_tensor = self.arena[name][slot]
            if slot_tensor.dtype != tensor.dtype:
                # carry the stored bytes as they are (asynchronous from pinned memory) and convert on
                # the device: copy_ across devices and dtypes would convert on the host into a pageable
                # temporary first, a synchronous CPU pass over every fetched expert
                tensor = tensor.to(self.device, non_blocking=True)
            slot_tensor.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            entry.loaded = torch.cuda.Event()
            entry.loaded.record(torch.cuda.current_stream(self.device))


def _budget_bytes(expert_cache_bytes: int | None, expert_cache_fraction: float | None, all_expert_bytes: int) -> int:
    if (expert_cache_bytes is None) == (expert_cache_fraction is None):
        raise ValueError(
            f"give exactly one of expert_cache_bytes or expert_cache_fraction; got "
            f"expert_cache_bytes={expert_cache_bytes}, expert_cache_fraction={expert_cache_fraction}"
        )
    if expert_cache_fraction is not None:
        if not 0.0 < expert_cache_fraction <= 1.0:
            raise ValueError(f"expert_cache_fraction must be in (0, 1], got {expert_cache_fraction}")
        return int(expert_cache_fraction * all_expert_bytes)
    if expert_cache_bytes is None or expert_cache_bytes < 0:
        raise ValueError(f"expert_cache_bytes must be >= 0, got {expert_cache_bytes}")
    return int(expert_cache_bytes)
