"""Verify admission: the pure 2-D deficit function and the async ticket scheduler around it.

Owns: which pending verifies run in a tick (tokens x expert bytes), the carried deficit,
the bytes each demand is charged, and the tickets sequences await. Must not touch:
sequence state machines, model work, the expert cache (the engine hands each tick the
resident and in-flight expert sets and the byte map; this module only reads them).

Engine protocol, per sequence:  register -> await ticket.wait() -> (the engine loop calls
tick(), which admits) -> mark_in_flight (optional) -> finish.  An aborted sequence calls
cancel(seq_id), which is also what a cancelled waiter does by itself.
"""

from __future__ import annotations

import enum
import functools
import operator
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence, Set
from typing import Protocol

import anyio
import anyio.lowlevel
import attrs
import numpy as np

Expert = tuple[int, int]  # (layer index, expert index)


# --- value types -------------------------------------------------------------------------


@attrs.frozen
class Deficit2D:
    """A (tokens, expert bytes) pair: a budget, a carried deficit, a cap or a pool."""

    tokens: int  # tokens
    expert_bytes: int  # bytes


@attrs.frozen
class VerifyDemand:
    """What one pending verify asks of a tick."""

    seq_id: Hashable  # the sequence whose verify this is
    tokens: int  # tokens in the block to verify
    expert_bytes: int  # bytes charged for its projected routed union (see charge_bytes)
    in_flight: bool = False  # verify running / prefetch under way: seated unconditionally
    skipped_ticks: int = 0  # ticks that passed this demand over (starvation guard input)


@attrs.frozen
class VerifyAdmission:
    """What one tick decided."""

    seated_ids: tuple  # seq_ids of in-flight demands, seated first, in input order
    admitted_ids: tuple  # seq_ids of newly admitted demands, in input order
    carried: Deficit2D  # unused quantum carried to the next tick, in [0, cap] (tokens, bytes)


# --- the pure function -------------------------------------------------------------------


def admit_verify_demands(
    demands: Iterable[VerifyDemand],
    budget: Deficit2D,
    carried: Deficit2D,
    cap: Deficit2D,
    *,
    barrier_after: int = 4,
) -> VerifyAdmission:
    """One tick of 2-D deficit admission (ARCHITECTURE "2-D deficit admission").

    In-flight demands are seated first; the rest are admitted first-fit, in order, while
    they fit in BOTH dimensions of pool = budget + carried - seated. A demand already
    skipped `barrier_after` times that does not fit is a barrier: nothing after it is
    admitted, so the pool carries over for it. Carry out = clamp(pool, 0, cap).
    Pure: inputs are not mutated, nothing else is touched.
    """
    demands = tuple(demands)
    _validate_admission_inputs(demands, budget, carried, cap, barrier_after)

    seated = [d for d in demands if d.in_flight]
    pool_tokens = budget.tokens + carried.tokens - sum(d.tokens for d in seated)
    pool_bytes = budget.expert_bytes + carried.expert_bytes - sum(d.expert_bytes for d in seated)

    admitted = []
    for d in demands:
        if d.in_flight:
            continue
        if d.tokens <= pool_tokens and d.expert_bytes <= pool_bytes:
            admitted.append(d.seq_id)
            pool_tokens -= d.tokens
            pool_bytes -= d.expert_bytes
        elif d.skipped_ticks >= barrier_after:
            break  # starvation guard: the pool is saved for this demand

    return VerifyAdmission(
        seated_ids=tuple(d.seq_id for d in seated),
        admitted_ids=tuple(admitted),
        carried=Deficit2D(
            tokens=min(max(pool_tokens, 0), cap.tokens),
            expert_bytes=min(max(pool_bytes, 0), cap.expert_bytes),
        ),
    )


def _validate_admission_inputs(demands, budget, carried, cap, barrier_after) -> None:
    if barrier_after < 0:
        raise ValueError(f"barrier_after={barrier_after} is negative; it must be >= 0")
    for name, pair in (("budget", budget), ("carried", carried), ("cap", cap)):
        for dim in ("tokens", "expert_bytes"):
            if getattr(pair, dim) < 0:
                raise ValueError(f"{name}.{dim}={getattr(pair, dim)} is negative; it must be >= 0")
    for d in demands:
        for field in ("tokens", "expert_bytes", "skipped_ticks"):
            if getattr(d, field) < 0:
                raise ValueError(
                    f"demand {d.seq_id!r} has {field}={getattr(d, field)}, which is negative; it must be >= 0"
                )
    for dim in ("tokens", "expert_bytes"):
        largest = max(demands, key=lambda d: getattr(d, dim), default=None)
        if largest is not None and getattr(largest, dim) > getattr(cap, dim):
            raise ValueError(
                f"cap.{dim}={getattr(cap, dim)} is smaller than the {dim} of demand "
                f"{largest.seq_id!r} ({getattr(largest, dim)}), which could then never be "
                f"admitted; cap.{dim} must be >= {getattr(largest, dim)}"
            )


# --- which bytes a demand is charged ------------------------------------------------------


class ChargeMode(enum.Enum):
    """How many bytes a pending verify is charged against the byte budget."""

    FULL = "full"  # every byte of its projected union, shared or not
    FETCH = "fetch"  # the part not resident when its route was projected (as registered)
    MARGINAL = "marginal"  # the bytes its union adds to what is resident / coming / charged


class Chargeable(Protocol):
    union: frozenset[Expert]  # projected routed union, (layer, expert) pairs
    full_bytes: int  # bytes: sum of the byte map over `union`
    fetch_bytes: int  # bytes of `union` not resident at projection time


class ExpertMasks:
    """Sets of experts as int bitmasks over one byte map: the marginal charge in big-int operations.

    As sets, charging one pending union is a set difference over its experts (about 75 ms per
    tick for 256 Qwen3-30B-A3B-sized unions of ~2,500 experts on one CPU core). As masks it is
    an and-not and one popcount per distinct expert size; a union becomes a mask once, when its
    verify is first charged (bench_admission.py times both parts).
    """

    SMALL = 64  # experts up to which or-ing single bits beats numpy's fixed cost

    def __init__(self, byte_map: Mapping[Expert, int]) -> None:
        self.byte_map = byte_map
        self._bit = {expert: i for i, expert in enumerate(byte_map)}
        self._single = {expert: 1 << i for expert, i in self._bit.items()}
        by_size: dict[int, list[Expert]] = defaultdict(list)
        for expert, size in byte_map.items():
            by_size[size].append(expert)
        self._sizes = tuple((size, self.mask(experts)) for size, experts in by_size.items())

    def mask(self, experts: Collection[Expert]) -> int:
        """The mask of `experts`; KeyError for an expert the byte map lacks."""
        if len(experts) <= self.SMALL:  # 3 µs for 36 experts, against 4 µs through numpy
            return functools.reduce(operator.or_, map(self._single.__getitem__, experts), 0)
        flags = np.zeros(len(self._bit), dtype=bool)
        flags[np.fromiter(map(self._bit.__getitem__, experts), dtype=np.int64)] = True
        return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

    def nbytes(self, mask: int) -> int:
        """Σ of the byte map over the experts in `mask`."""
        return sum(size * (mask & members).bit_count() for size, members in self._sizes)


def marginal_charges(masks: ExpertMasks, unions: Sequence[int], covered: int) -> list[int]:
    """What each union (a mask, in admission order) adds to `covered` and the unions before it."""
    charges = []
    for union in unions:
        new = union & ~covered
        charges.append(masks.nbytes(new))
        covered |= new
    return charges


def charge_bytes(
    pending: Sequence[Chargeable],
    mode: ChargeMode | str,
    byte_map: Mapping[Expert, int] | None,
    resident: Set[Expert],
    in_flight: Set[Expert],
) -> list[int]:
    """Bytes to charge each pending verify, in the order given (the admission order).

    MARGINAL charges item i the byte map summed over
        union_i - resident - in_flight - (union_0 | ... | union_{i-1}).
    ARCHITECTURE asks for the unions *admitted* this tick, but charges are needed before
    admission, so this charges against every earlier candidate, admitted or not. The error
    is one-sided: when an earlier candidate is skipped, a later one that shares its experts
    is undercharged by exactly those shared bytes, so a tick may move more bytes than its
    budget by at most what admitted demands share with skipped ones ahead of them; that
    excess is never charged to a later tick either. The scheduler keeps each union's mask
    across ticks; this function builds them afresh.
    """
    mode = ChargeMode(mode)
    if mode is ChargeMode.FULL:
        return [p.full_bytes for p in pending]
    if mode is ChargeMode.FETCH:
        return [p.fetch_bytes for p in pending]
    if byte_map is None:
        raise ValueError("charge mode 'marginal' needs the byte map; got byte_map=None")
    masks = ExpertMasks(byte_map)
    covered = masks.mask(resident) | masks.mask(in_flight)
    return marginal_charges(masks, [masks.mask(p.union) for p in pending], covered)


# --- the async scheduler ------------------------------------------------------------------


class AdmissionCancelled(Exception):
    """Raised by Ticket.wait() when the demand was cancelled before it was admitted."""


@attrs.frozen
class VerifyRequest:
    """What a sequence registered: its pending verify, before it is charged."""

    seq_id: Hashable  # the sequence
    tokens: int  # tokens in the block to verify
    union: frozenset[Expert]  # projected routed union, (layer, expert) pairs
    full_bytes: int  # bytes: sum of the byte map over `union`
    fetch_bytes: int  # bytes of `union` not resident at projection time


@attrs.define(eq=False)
class Ticket:
    """One registration's admission ticket; a sequence's coroutine awaits `wait()`."""

    seq_id: Hashable
    _release: Callable[[Ticket], None]  # the scheduler's cleanup for a cancelled waiter
    _event: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    _cancelled: bool = attrs.field(default=False, init=False)

    @property
    def admitted(self) -> bool:
        return self._event.is_set() and not self._cancelled

    async def wait(self) -> None:
        """Return once a tick admits the demand; raise AdmissionCancelled if it was cancelled.

        A waiter cancelled while waiting (even just after admission) hands its demand
        back, so neither its place nor an already granted share of the budget leaks.
        """
        try:
            await self._event.wait()
            await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled while being woken
        except BaseException:
            self._release(self)
            raise
        if self._cancelled:
            raise AdmissionCancelled(f"the verify demand of sequence {self.seq_id!r} was cancelled")

    def _admit(self) -> None:
        self._event.set()

    def _cancel(self) -> None:
        self._cancelled = True
        self._event.set()


@attrs.define(eq=False)
class _Entry:
    request: VerifyRequest
    ticket: Ticket
    registered_at: float  # seconds (scheduler clock), first registration
    skipped_ticks: int = 0  # ticks that passed it over
    admitted_tick: int = -1  # tick number that admitted it
    charge: Deficit2D = Deficit2D(0, 0)  # (tokens, bytes) charged when admitted
    _mask: tuple[VerifyRequest, ExpertMasks, int] | None = None  # its union's mask, and for what

    def union_mask(self, masks: ExpertMasks) -> int:
        """Its request's union as a mask of `masks`, built once per registration."""
        if self._mask is None or self._mask[0] is not self.request or self._mask[1] is not masks:
            self._mask = (self.request, masks, masks.mask(self.request.union))
        return self._mask[2]


@attrs.frozen
class SchedulerStats:
    ticks: int  # ticks run
    admitted: int  # demands admitted, all time
    pending: int  # demands waiting now
    in_flight: int  # demands seated every tick now
    wait_p50_s: float | None  # admission wait, seconds, over the last WAIT_SAMPLES admissions
    wait_p99_s: float | None  # same, 99th percentile
    last_tick_s: float | None  # seconds the last tick() took


WAIT_SAMPLES = 4096


class VerifyScheduler:
    """Arrival order, carried deficit and tickets around `admit_verify_demands`.

    2-D mode: all of token_budget, token_cap, byte_budget, byte_cap. Token-only mode:
    byte_budget and byte_cap both None; every demand is then charged 0 bytes against a
    0-byte budget and cap, so the byte dimension always fits and never carries.
    Budgets are per tick; caps bound the carried deficit and the largest single demand.
    """

    def __init__(
        self,
        *,
        token_budget: int,
        token_cap: int,
        byte_budget: int | None = None,
        byte_cap: int | None = None,
        barrier_after: int = 4,
        charge_mode: ChargeMode | str = ChargeMode.MARGINAL,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if (byte_budget is None) != (byte_cap is None):
            raise ValueError(
                "byte_budget and byte_cap go together (all four budgets, or token-only with "
                f"neither): got byte_budget={byte_budget!r}, byte_cap={byte_cap!r}"
            )
        self.token_only = byte_budget is None
        _require_int("token_budget", token_budget, 1, "a tick without token budget admits nothing")
        _require_int("token_cap", token_cap, 0, "it bounds the carried tokens")
        if not self.token_only:
            _require_int("byte_budget", byte_budget, 1, "a tick without byte budget admits nothing")
            _require_int("byte_cap", byte_cap, 0, "it bounds the carried bytes")
        _require_int("barrier_after", barrier_after, 0, "it counts skipped ticks")
        try:
            self.charge_mode = ChargeMode(charge_mode)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in ChargeMode)
            raise ValueError(f"charge_mode={charge_mode!r} is not one of {valid}") from None
        self.budget = Deficit2D(token_budget, byte_budget or 0)  # per tick
        self.cap = Deficit2D(token_cap, byte_cap or 0)
        self.barrier_after = barrier_after
        self._clock = clock

        self._queue: dict[Hashable, _Entry] = {}  # waiting, in arrival order
        self._admitted: dict[Hashable, _Entry] = {}  # admitted, not (yet) seated
        self._in_flight: dict[Hashable, _Entry] = {}  # seated every tick until finish
        self._carried = Deficit2D(0, 0)
        self._pool = (0, 0)  # the last tick's unclamped leftover: refunds and re-assignment
        self._ticks = 0
        self._admitted_total = 0
        self._waits: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self._last_tick_s: float | None = None
        self._masks: ExpertMasks | None = None  # over the byte map the last tick was given

    # -- configuration checks --

    def validate_block(self, tokens: int) -> None:
        """Reject a configuration that could never admit a verify block of `tokens`."""
        _require_int("tokens", tokens, 1, "a verify block holds at least one token")
        if tokens > self.cap.tokens:
            raise ValueError(
                f"token_cap={self.cap.tokens} is smaller than one verify block of {tokens} "
                f"tokens, which could then never be admitted; token_cap must be >= {tokens}"
            )

    # -- the sequence side --

    def register(
        self,
        seq_id: Hashable,
        tokens: int,
        union: Iterable[Expert] = frozenset(),
        full_bytes: int = 0,
        fetch_bytes: int = 0,
    ) -> Ticket:
        """Queue a pending verify; a seq_id already waiting is updated in its place."""
        request = VerifyRequest(seq_id, tokens, frozenset(union), full_bytes, fetch_bytes)
        self._check_request(request)
        if seq_id in self._admitted or seq_id in self._in_flight:
            raise ValueError(
                f"sequence {seq_id!r} already has an admitted verify; "
                "call finish(seq_id) before registering its next one"
            )
        entry = self._queue.get(seq_id)
        if entry is not None:
            entry.request = request  # keeps its place, its skipped ticks and its ticket
            return entry.ticket
        ticket = Ticket(seq_id, self._release)
        self._queue[seq_id] = _Entry(request, ticket, registered_at=self._clock())
        return ticket

    def mark_in_flight(self, seq_id: Hashable) -> None:
        """The admitted verify of `seq_id` is running: seat it every tick until finish."""
        if seq_id not in self._admitted:
            raise KeyError(f"sequence {seq_id!r} has no admitted verify to mark in flight")
        self._in_flight[seq_id] = self._admitted.pop(seq_id)

    def finish(self, seq_id: Hashable) -> None:
        """The verify of `seq_id` is done; it stops being seated."""
        if self._admitted.pop(seq_id, None) is None and self._in_flight.pop(seq_id, None) is None:
            raise KeyError(f"sequence {seq_id!r} has no admitted or in-flight verify to finish")

    def cancel(self, seq_id: Hashable) -> bool:
        """Drop whatever `seq_id` holds here and re-run assignment; False if it held nothing.

        A waiting demand is removed (its waiter gets AdmissionCancelled). A demand admitted
        by the current tick and not yet running gives its charge back to the pool. Either
        may let waiting demands in without a new tick (a removed barrier, a refund).
        """
        if (entry := self._queue.pop(seq_id, None)) is not None:
            entry.ticket._cancel()
        elif (entry := self._admitted.pop(seq_id, None)) is not None:
            if entry.admitted_tick == self._ticks:
                self._pool = (
                    self._pool[0] + entry.charge.tokens,
                    self._pool[1] + entry.charge.expert_bytes,
                )
        elif self._in_flight.pop(seq_id, None) is None:
            return False
        self._reassign()
        return True

    def _release(self, ticket: Ticket) -> None:
        """A waiter was cancelled: cancel its demand unless a newer registration replaced it."""
        for table in (self._queue, self._admitted):
            entry = table.get(ticket.seq_id)
            if entry is not None and entry.ticket is ticket:
                self.cancel(ticket.seq_id)
                return

    # -- the engine side --

    def tick(
        self,
        resident: Set[Expert] = frozenset(),
        in_flight_union: Set[Expert] = frozenset(),
        byte_map: Mapping[Expert, int] | None = None,
    ) -> VerifyAdmission:
        """One admission step; synchronous and await-free, run by the engine loop.

        `resident`: experts in the device cache; `in_flight_union`: experts whose copy is
        already under way (and paid for by an earlier tick). Seated demands are charged
        first, so a running verify whose union is in neither still pays its missing bytes.
        """
        start = self._clock()
        seated = list(self._in_flight.values())
        waiting = list(self._queue.values())
        charges = self._charges(seated + waiting, resident, in_flight_union, byte_map)
        demands = self._as_demands(seated + waiting, charges, n_seated=len(seated))
        result = admit_verify_demands(demands, self.budget, self._carried, self.cap, barrier_after=self.barrier_after)
        self._ticks += 1
        used = _sum(demands, set(result.seated_ids) | set(result.admitted_ids))
        self._pool = (
            self.budget.tokens + self._carried.tokens - used.tokens,
            self.budget.expert_bytes + self._carried.expert_bytes - used.expert_bytes,
        )
        self._carried = result.carried
        self._hand_out(result.admitted_ids, demands)
        for entry in self._queue.values():
            entry.skipped_ticks += 1
        self._last_tick_s = self._clock() - start
        return result

    def pending_count(self) -> int:
        return len(self._queue)

    @property
    def carried(self) -> Deficit2D:
        return self._carried

    def stats(self) -> SchedulerStats:
        waits = sorted(self._waits)
        return SchedulerStats(
            ticks=self._ticks,
            admitted=self._admitted_total,
            pending=len(self._queue),
            in_flight=len(self._in_flight),
            wait_p50_s=_percentile(waits, 0.50),
            wait_p99_s=_percentile(waits, 0.99),
            last_tick_s=self._last_tick_s,
        )

    # -- internals --

    def _check_request(self, r: VerifyRequest) -> None:
        for name in ("tokens", "full_bytes", "fetch_bytes"):
            _require_int(name, getattr(r, name), 0, f"it is a size (sequence {r.seq_id!r})")
        if r.fetch_bytes > r.full_bytes:
            raise ValueError(
                f"sequence {r.seq_id!r}: fetch_bytes={r.fetch_bytes} exceeds full_bytes="
                f"{r.full_bytes}; the fetched part of a union cannot exceed the union"
            )
        if r.tokens > self.cap.tokens:
            raise ValueError(
                f"sequence {r.seq_id!r}: tokens={r.tokens} exceeds token_cap={self.cap.tokens}, "
                "so it could never be admitted"
            )
        most = r.fetch_bytes if self.charge_mode is ChargeMode.FETCH else r.full_bytes
        if not self.token_only and most > self.cap.expert_bytes:
            raise ValueError(
                f"sequence {r.seq_id!r}: it may be charged {most} bytes, more than "
                f"byte_cap={self.cap.expert_bytes}, so it could never be admitted"
            )

    def _charges(self, entries, resident, in_flight_union, byte_map) -> list[int]:
        if self.token_only:
            return [0] * len(entries)
        if self.charge_mode is not ChargeMode.MARGINAL or byte_map is None:  # None: charge_bytes says why
            return charge_bytes([e.request for e in entries], self.charge_mode, byte_map, resident, in_flight_union)
        if self._masks is None or self._masks.byte_map is not byte_map:
            self._masks = ExpertMasks(byte_map)
        masks = self._masks
        unions = [e.union_mask(masks) for e in entries]
        return marginal_charges(masks, unions, masks.mask(resident) | masks.mask(in_flight_union))

    @staticmethod
    def _as_demands(entries, charges, n_seated: int) -> list[VerifyDemand]:
        return [
            VerifyDemand(
                seq_id=e.request.seq_id,
                tokens=e.request.tokens,
                expert_bytes=charge,
                in_flight=i < n_seated,
                skipped_ticks=e.skipped_ticks,
            )
            for i, (e, charge) in enumerate(zip(entries, charges))
        ]

    def _hand_out(self, admitted_ids: tuple, demands: list[VerifyDemand]) -> None:
        """Move admitted demands out of the queue and wake their waiters, in order."""
        if not admitted_ids:
            return
        now = self._clock()
        by_id = {d.seq_id: d for d in demands}
        for seq_id in admitted_ids:
            entry = self._queue.pop(seq_id)
            entry.admitted_tick = self._ticks
            entry.charge = Deficit2D(by_id[seq_id].tokens, by_id[seq_id].expert_bytes)
            self._admitted[seq_id] = entry
            self._admitted_total += 1
            self._waits.append(now - entry.registered_at)
            entry.ticket._admit()

    def _reassign(self) -> None:
        """Hand the current tick's leftover pool to waiting demands; not a new tick."""
        if self._pool[0] >= 0 and self._pool[1] >= 0 and self._queue:  # else nothing fits
            waiting = list(self._queue.values())
            if not self.token_only and self.charge_mode is ChargeMode.MARGINAL:
                # No fresh resident / in-flight sets between ticks: charge full unions (an
                # upper bound on the marginal bytes), so re-assignment never overspends.
                charges = [e.request.full_bytes for e in waiting]
            else:
                charges = self._charges(waiting, frozenset(), frozenset(), None)
            demands = self._as_demands(waiting, charges, n_seated=0)
            result = admit_verify_demands(
                demands,
                Deficit2D(*self._pool),
                Deficit2D(0, 0),
                self.cap,
                barrier_after=self.barrier_after,
            )
            used = _sum(demands, set(result.admitted_ids))
            self._pool = (self._pool[0] - used.tokens, self._pool[1] - used.expert_bytes)
            self._hand_out(result.admitted_ids, demands)
        self._carried = Deficit2D(
            tokens=min(max(self._pool[0], 0), self.cap.tokens),
            expert_bytes=min(max(self._pool[1], 0), self.cap.expert_bytes),
        )


def _sum(demands: Sequence[VerifyDemand], ids: set) -> Deficit2D:
    chosen = [d for d in demands if d.seq_id in ids]
    return Deficit2D(sum(d.tokens for d in chosen), sum(d.expert_bytes for d in chosen))


def _require_int(name: str, value, minimum: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an int >= {minimum} ({why})")


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    permille = round(q * 1000)
    rank = max(1, (permille * len(sorted_values) + 999) // 1000)  # ceil(q * n), exact
    return sorted_values[rank - 1]
