"""The ticket scheduler: arrival order, the carried deficit and admission tickets around the pure admission.

Owns which pending verifies a tick offers the pure admission (`first_fit_stream`), in what
order, with what byte charges (pdflash.engine.charging over the byte map it was built with,
on the masks of pdflash.engine.demand_table), the carry between ticks, and the tickets
sequences await. Must not touch sequence state machines, model work or the expert cache: the
engine hands each tick the resident and in-flight expert sets; this module only reads them.

Engine protocol, per sequence:  register -> await ticket.wait() -> (the engine calls
tick(), which admits) -> mark_in_flight (optional) -> finish.  An aborted sequence calls
cancel(seq_id), which is also what a cancelled waiter does by itself.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Set

import attrs

from pdflash.checks import require_int
from pdflash.engine.admission import ZERO, TokensBytes, VerifyAdmission, first_fit_stream, require_fits_cap
from pdflash.engine.charging import ChargeMode, ExpertMasks, MarginalCounter
from pdflash.engine.demand_table import DemandTable
from pdflash.engine.ordering import LOOK_AHEAD, by_yield, offer_order
from pdflash.engine.ticket import Ticket
from pdflash.measure import percentile
from pdflash.target.experts import ExpertKey


@attrs.frozen
class VerifyRequest:
    """What a sequence registered: its pending verify, before it is charged."""

    seq_id: Hashable  # the sequence
    tokens: int  # tokens in the block to verify
    union: frozenset[ExpertKey]  # projected routed union, (layer, expert) pairs
    full_bytes: int  # bytes: sum of the byte map over `union`
    fetch_bytes: int  # bytes of `union` not resident at projection time
    expected_tokens: float = 1.0  # E[tokens its verify commits]: the yield ordering's numerator


@attrs.define(eq=False)
class _Entry:
    request: VerifyRequest
    ticket: Ticket
    registered_at: float  # seconds (scheduler clock), first registration
    queued_tick: int  # ticks run when it was first queued: the ticks since then skipped it
    slot: int  # its columns in the scheduler's DemandTable
    admitted_tick: int = -1  # tick number that admitted it
    charged_bytes: int = 0  # bytes charged when admitted

    @property
    def charge(self) -> TokensBytes:
        """(tokens, bytes) charged when admitted (built when asked: a tick hands out many)."""
        return TokensBytes(self.request.tokens, self.charged_bytes)


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
_SLOT = operator.attrgetter("slot")  # an entry's DemandTable slot


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
        byte_map: Mapping[ExpertKey, int] | None = None,
        order: str = "arrival",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if (byte_budget is None) != (byte_cap is None):
            raise ValueError(
                "byte_budget and byte_cap go together (all four budgets, or token-only with "
                f"neither): got byte_budget={byte_budget!r}, byte_cap={byte_cap!r}"
            )
        self.token_only = byte_budget is None
        require_int("token_budget", token_budget, 1, why="a tick without token budget admits nothing")
        require_int("token_cap", token_cap, 0, why="it bounds the carried tokens")
        if not self.token_only:
            require_int("byte_budget", byte_budget, 1, why="a tick without byte budget admits nothing")
            require_int("byte_cap", byte_cap, 0, why="it bounds the carried bytes")
        require_int("barrier_after", barrier_after, 0, why="it counts skipped ticks")
        self.charge_mode = ChargeMode.parse(charge_mode)
        if self.charge_mode is ChargeMode.MARGINAL and not self.token_only and byte_map is None:
            raise ValueError("charge mode 'marginal' needs the byte map; got byte_map=None")
        self.budget = TokensBytes(token_budget, byte_budget or 0)  # per tick
        self.cap = TokensBytes(token_cap, byte_cap or 0)
        self.barrier_after = barrier_after
        offer_order([], order, barrier_after)  # validates `order`
        self.order = order if not self.token_only else "arrival"  # without bytes there is no yield to order by
        self._clock = clock

        self._queue: dict[Hashable, _Entry] = {}  # waiting, in arrival order
        self._admitted: dict[Hashable, _Entry] = {}  # admitted, not (yet) seated
        self._in_flight: dict[Hashable, _Entry] = {}  # seated every tick until finish
        self._carried = ZERO
        self._pool = (0, 0)  # the last tick's unclamped leftover: refunds and re-assignment
        self._ticks = 0
        self._admitted_total = 0
        self._waits: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self._last_tick_s: float | None = None
        self._masks = ExpertMasks(byte_map) if byte_map is not None and not self.token_only else None
        self._table = DemandTable(self._masks)  # masks built at registration, off the tick (see `_all_fit`)
        self._all_fitting = False  # the last tick admitted every demand unread: masks wait until read
        # bytes of every expert: marginal charges of one tick never sum to more
        self._every_expert_bytes = self._masks.nbytes(self._masks.everything) if self._masks is not None else 0

    # -- configuration checks --

    def validate_block(self, tokens: int) -> None:
        """Reject a configuration that could never admit a verify block of `tokens`."""
        require_int("tokens", tokens, 1, why="a verify block holds at least one token")
        require_fits_cap("token_cap", self.cap.tokens, tokens, f"one verify block of {tokens} tokens")

    # -- the sequence side --

    def register(
        self,
        seq_id: Hashable,
        tokens: int,
        union: Iterable[ExpertKey] = frozenset(),
        full_bytes: int = 0,
        fetch_bytes: int = 0,
        expected_tokens: float = 1.0,
    ) -> Ticket:
        """Queue a pending verify; a seq_id already waiting is updated in its place."""
        request = VerifyRequest(seq_id, tokens, frozenset(union), full_bytes, fetch_bytes, expected_tokens)
        self._check_request(request)
        if seq_id in self._admitted or seq_id in self._in_flight:
            raise ValueError(
                f"sequence {seq_id!r} already has an admitted verify; "
                "call finish(seq_id) before registering its next one"
            )
        entry = self._queue.get(seq_id)
        if entry is not None:
            entry.request = request  # keeps its place, its skipped ticks and its ticket
        else:
            ticket = Ticket(seq_id, self._release)
            entry = self._queue[seq_id] = _Entry(request, ticket, self._clock(), self._ticks, self._table.add())
        self._table.set(entry.slot, tokens, expected_tokens, request.union, build=not self._all_fitting)
        return entry.ticket

    def mark_in_flight(self, seq_id: Hashable) -> None:
        """The admitted verify of `seq_id` is running: seat it every tick until finish."""
        if seq_id not in self._admitted:
            raise KeyError(f"sequence {seq_id!r} has no admitted verify to mark in flight")
        self._in_flight[seq_id] = self._admitted.pop(seq_id)

    def finish(self, seq_id: Hashable) -> None:
        """The verify of `seq_id` is done; it stops being seated."""
        entry = self._admitted.pop(seq_id, None) or self._in_flight.pop(seq_id, None)
        if entry is None:
            raise KeyError(f"sequence {seq_id!r} has no admitted or in-flight verify to finish")
        self._table.free(entry.slot)

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
                self._pool = (self._pool[0] + entry.request.tokens, self._pool[1] + entry.charged_bytes)
        elif (entry := self._in_flight.pop(seq_id, None)) is None:
            return False
        self._table.free(entry.slot)
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
        resident: Set[ExpertKey] = frozenset(),
        in_flight_union: Set[ExpertKey] = frozenset(),
        *,
        budget: TokensBytes | None = None,
    ) -> VerifyAdmission:
        """One admission step; synchronous and await-free, run by the engine loop.

        `resident`: experts in the device cache; `in_flight_union`: experts whose copy is
        already under way (and paid for by an earlier tick). Seated demands are charged
        first, so a running verify whose union is in neither still pays its missing bytes.
        """
        start = self._clock()
        if budget is not None:  # derived budgets: this tick's quantum (the caps stay)
            self.budget = budget
        seated = list(self._in_flight.values())
        pool_tokens = self.budget.tokens + self._carried.tokens - sum([e.request.tokens for e in seated])
        waiting_tokens = self._all_fit(pool_tokens)
        self._all_fitting = waiting_tokens is not None
        admitted: list[_Entry] | None = None  # None: every waiting demand, handed over whole
        charges: list[int] = []
        if waiting_tokens is not None:  # nothing to rank or charge: every waiting demand goes
            self._pool = (pool_tokens - waiting_tokens, self.budget.expert_bytes + self._carried.expert_bytes)
        else:
            covered, inside = None, frozenset[int]()  # mask of resident ∪ in flight, when charges or order need it
            if self._masks is not None and (self.charge_mode is ChargeMode.MARGINAL or self.order != "arrival"):
                covered, inside = self._table.covered(resident, in_flight_union)
            charge = self._charger(covered, inside)
            pool_bytes = self.budget.expert_bytes + self._carried.expert_bytes - sum([charge(e) for e in seated])
            admitted, charges, self._pool = self._first_fit(self._line(covered), charge, pool_tokens, pool_bytes)
        self._ticks += 1  # every demand still queued after this was skipped by it
        self._carried = TokensBytes(*self._pool).clamped(self.cap)
        admitted_ids = self._hand_out_all() if admitted is None else self._hand_out(admitted, charges)
        self._last_tick_s = self._clock() - start
        seated_ids = tuple([e.request.seq_id for e in seated])
        return VerifyAdmission(seated_ids=seated_ids, admitted_ids=admitted_ids, carried=self._carried)

    def pending_count(self) -> int:
        return len(self._queue)

    def admitted_ids(self) -> list[Hashable]:
        """Demands admitted (by a tick, or by re-assignment after a cancel) and not yet marked in flight."""
        return list(self._admitted)

    @property
    def carried(self) -> TokensBytes:
        return self._carried

    def stats(self) -> SchedulerStats:
        waits = sorted(self._waits)
        return SchedulerStats(
            ticks=self._ticks,
            admitted=self._admitted_total,
            pending=len(self._queue),
            in_flight=len(self._in_flight),
            wait_p50_s=percentile(waits, 0.50),
            wait_p99_s=percentile(waits, 0.99),
            last_tick_s=self._last_tick_s,
        )

    # -- internals --

    def _check_request(self, r: VerifyRequest) -> None:
        for name in ("tokens", "full_bytes", "fetch_bytes"):
            require_int(name, getattr(r, name), 0, why=f"it is a size (sequence {r.seq_id!r})")
        if r.fetch_bytes > r.full_bytes:
            raise ValueError(
                f"sequence {r.seq_id!r}: fetch_bytes={r.fetch_bytes} exceeds full_bytes="
                f"{r.full_bytes}; the fetched part of a union cannot exceed the union"
            )
        who = f"the verify of sequence {r.seq_id!r}"
        require_fits_cap("token_cap", self.cap.tokens, r.tokens, f"the tokens of {who}")
        if not self.token_only:
            most = r.fetch_bytes if self.charge_mode is ChargeMode.FETCH else r.full_bytes
            require_fits_cap("byte_cap", self.cap.expert_bytes, most, f"the bytes {who} may be charged")

    def _all_fit(self, pool_tokens: int) -> int | None:
        """The waiting demands' tokens if every one fits this tick whatever its order and charges
        (None if not): their tokens in the pool, and bytes to spare for every expert (a tick's
        marginal charges, the seated ones' included, count each expert once at most; token-only
        charges nothing).
        Then nothing is ranked or charged (its whole byte pool carries, up to the cap), and the
        demands registered after it build their masks only when a tick reads them. Every tick
        of the derived budgets, whose bytes are every expert's and tokens every seat's block
        (docs/engine.md, "Derived budgets never bind")."""
        if not self.token_only and self.charge_mode is not ChargeMode.MARGINAL:
            return None  # full and fetch charges count a shared expert once per demand
        if self.budget.expert_bytes + self._carried.expert_bytes < self._every_expert_bytes:
            return None
        waiting_tokens = sum([e.request.tokens for e in self._queue.values()])
        return waiting_tokens if pool_tokens >= waiting_tokens else None

    def _line(self, covered: int | None) -> Iterator[_Entry]:
        """The waiting demands in the order this tick offers them (pdflash.engine.ordering), as
        first-fit pulls them. The guarded ones come first, in arrival order; as queued ticks
        only grow along the arrival order, they are a prefix of it. The rest is ordered (their
        bytes counted beyond `covered`, the oldest LOOK_AHEAD of them) only if first-fit gets that far."""
        waiting, last_guarded = iter(self._queue.values()), self._ticks - self.barrier_after
        for entry in waiting:
            if entry.queued_tick > last_guarded:
                break
            yield entry
        else:
            return
        if self.order == "arrival" or covered is None:
            yield entry
            yield from waiting
            return
        ranked = [entry, *itertools.islice(waiting, LOOK_AHEAD - 1)]  # none guarded: ordered by yield alone
        slots = list(map(_SLOT, ranked))
        expected = self._table.expected
        yield from map(
            ranked.__getitem__, by_yield([expected[s] for s in slots], self._table.alone_bytes(slots, covered))
        )
        yield from waiting  # behind the look-ahead: arrival order

    def _charger(self, covered: int | None, inside: Set[int] = frozenset()) -> Callable[[_Entry], int]:
        """Bytes to charge each demand it is called on, in the order called: marginal charges
        count each union beyond `covered` and every union charged before it (none for the
        slots `inside` it: the running batch, whose unions are the parts of the in-flight set)."""
        if self.token_only:
            return lambda entry: 0
        if self.charge_mode is ChargeMode.MARGINAL and covered is not None and self._masks is not None:
            counter, mask = MarginalCounter(self._masks, covered), self._table.mask
            return lambda entry: 0 if entry.slot in inside else counter(mask(entry.slot))
        if self.charge_mode is ChargeMode.FETCH:
            return lambda entry: entry.request.fetch_bytes
        return lambda entry: entry.request.full_bytes  # full; marginal's upper bound between ticks

    def _first_fit(
        self, line: Iterable[_Entry], charge: Callable[[_Entry], int], pool_tokens: int, pool_bytes: int
    ) -> tuple[list[_Entry], list[int], tuple[int, int]]:
        """`first_fit_stream` over `line` (charged by `charge`): admitted, their charges, the pool left."""
        offered: list[tuple[_Entry, int]] = []

        def columns(ticks: int = self._ticks) -> Iterator[tuple[int, int, int]]:
            for entry in line:
                offered.append((entry, bytes_charged := charge(entry)))
                yield entry.request.tokens, bytes_charged, ticks - entry.queued_tick

        fewest = self._table.fewest_tokens()
        picked, *pool = first_fit_stream(columns(), pool_tokens, pool_bytes, self.barrier_after, fewest)
        return [offered[i][0] for i in picked], [offered[i][1] for i in picked], (pool[0], pool[1])

    def _hand_out(self, admitted: list[_Entry], charges: Iterable[int]) -> tuple[Hashable, ...]:
        """Move admitted demands out of the queue and wake their waiters, in order: their seq_ids."""
        if not admitted:
            return ()
        now, ids = self._clock(), []
        self._admitted_total += len(admitted)
        for entry, charge in zip(admitted, charges, strict=True):
            ids.append(seq_id := entry.request.seq_id)
            del self._queue[seq_id]
            entry.admitted_tick, entry.charged_bytes = self._ticks, charge
            self._admitted[seq_id] = entry
            self._waits.append(now - entry.registered_at)
            entry.ticket._admit()
        return tuple(ids)

    def _hand_out_all(self) -> tuple[Hashable, ...]:
        """`_hand_out` of every waiting demand at no byte charge (a tick in which all fit), the
        queue handed over whole: its seq_ids, in order. At 256 waiting this is most of the tick,
        so what can be done once for all of them is (the dict moves, the waits)."""
        admitted, self._queue = self._queue, {}
        if not admitted:
            return ()
        now, tick, entries = self._clock(), self._ticks, list(admitted.values())
        self._admitted |= admitted
        self._admitted_total += len(entries)
        self._waits.extend([now - e.registered_at for e in entries])
        for entry in entries:  # charged_bytes stays 0: an entry is admitted once
            entry.admitted_tick = tick
            entry.ticket._admit()
        return tuple(admitted)

    def _reassign(self) -> None:
        """Hand the current tick's leftover pool to waiting demands, in arrival order; not a new tick.
        No fresh resident / in-flight sets between ticks: marginal charges are full unions (an
        upper bound on the marginal bytes), so re-assignment never overspends."""
        if self._queue:
            admitted, charges, self._pool = self._first_fit(self._queue.values(), self._charger(None), *self._pool)
            self._hand_out(admitted, charges)
        self._carried = TokensBytes(*self._pool).clamped(self.cap)
