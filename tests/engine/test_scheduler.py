"""Verify admission: the 2-D deficit function's vectors and properties, byte charging, and
the async ticket scheduler (order, cancellation, token-only mode, configuration errors)."""

from __future__ import annotations

import copy
import math
import random

import anyio
import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.admission import TokensBytes, VerifyAdmission, VerifyDemand, admit_verify_demands
from pdflash.engine.charging import ChargeMode, ExpertMasks, charge_bytes
from pdflash.engine.ordering import LOOK_AHEAD, OrderKey, offer_order
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.engine.ticket import AdmissionCancelled

BUDGET = TokensBytes(16, 80)
CAP = TokensBytes(32, 160)
ZERO = TokensBytes(0, 0)
PROPS = settings(max_examples=200, deadline=None)


def admit(demands, budget=BUDGET, carried=ZERO, cap=CAP, **kw) -> VerifyAdmission:
    return admit_verify_demands(demands, budget, carried, cap, **kw)


# --- the hand-checked vectors (ARCHITECTURE "2-D deficit admission") ------------------------


def test_in_flight_is_seated_and_the_rest_of_the_pool_admits_a_new_demand():
    # pool = (16,80) - (8,40) = (8,40); the new (8,40) fits exactly -> carry (0,0)
    out = admit([VerifyDemand("run", 8, 40, in_flight=True), VerifyDemand("new", 8, 40)])
    assert out == VerifyAdmission(seated_ids=("run",), admitted_ids=("new",), carried=ZERO)


def test_a_demand_over_the_byte_pool_waits_and_the_whole_budget_carries():
    # 90 bytes > 80: not admitted; pool (16,80) is under the cap -> carried whole
    out = admit([VerifyDemand("a", 8, 90)])
    assert out == VerifyAdmission((), (), TokensBytes(16, 80))


def test_three_equal_demands_admit_the_first_two_that_fill_the_budget():
    out = admit([VerifyDemand(s, 8, 40) for s in "abc"])
    assert out == VerifyAdmission((), ("a", "b"), ZERO)


def test_a_demand_larger_than_one_budget_is_admitted_on_the_carried_deficit():
    big = [VerifyDemand("big", 24, 120)]
    tick1 = admit(big)  # (24,120) > (16,80)
    assert tick1 == VerifyAdmission((), (), TokensBytes(16, 80))
    tick2 = admit(big, carried=tick1.carried)  # pool (32,160) -> leaves (8,40)
    assert tick2 == VerifyAdmission((), ("big",), TokensBytes(8, 40))


def test_first_fit_skips_a_demand_over_the_token_pool_and_admits_the_next():
    # (20,10): 20 > 16 tokens, skipped; (4,10) fits -> pool (12,70)
    out = admit([VerifyDemand("wide", 20, 10), VerifyDemand("narrow", 4, 10)])
    assert out == VerifyAdmission((), ("narrow",), TokensBytes(12, 70))


def test_a_cap_below_a_single_demand_raises_naming_tokens():
    with pytest.raises(ValueError, match=r"cap\.tokens=16 .*'a' \(24\).*must be >= 24"):
        admit([VerifyDemand("a", 24, 10)], cap=TokensBytes(16, 80))


def test_a_cap_below_a_single_demand_raises_naming_expert_bytes():
    with pytest.raises(ValueError, match=r"cap\.expert_bytes=80 .*'a' \(90\).*must be >= 90"):
        admit([VerifyDemand("a", 8, 90)], cap=TokensBytes(16, 80))


def test_an_in_flight_demand_over_budget_is_still_seated_and_carry_clamps_at_zero():
    # pool = (16,80) - (40,200) = (-24,-120) -> clamp to (0,0)
    out = admit([VerifyDemand("run", 40, 200, in_flight=True)], cap=TokensBytes(64, 320))
    assert out == VerifyAdmission(("run",), (), ZERO)


GUARD_QUEUE = [
    VerifyDemand("big", 24, 120, skipped_ticks=4),
    VerifyDemand("s1", 8, 40),
    VerifyDemand("s2", 8, 40),
]


def test_a_demand_skipped_barrier_after_times_blocks_the_demands_behind_it():
    tick1 = admit(GUARD_QUEUE)
    assert tick1 == VerifyAdmission((), (), TokensBytes(16, 80))
    # pool (32,160): big -> (8,40), s1 -> (0,0), s2 does not fit
    tick2 = admit(GUARD_QUEUE, carried=tick1.carried)
    assert tick2 == VerifyAdmission((), ("big", "s1"), ZERO)


def test_without_enough_skips_the_large_demand_is_passed_over_first_fit():
    fresh = [VerifyDemand("big", 24, 120, skipped_ticks=0)] + GUARD_QUEUE[1:]
    assert admit(fresh) == VerifyAdmission((), ("s1", "s2"), ZERO)


# --- validation and purity -----------------------------------------------------------------


@pytest.mark.parametrize(
    "demands, budget, carried, cap, match",
    [
        ([VerifyDemand("a", -1, 0)], BUDGET, ZERO, CAP, r"demand 'a' has tokens=-1"),
        ([VerifyDemand("a", 1, -5)], BUDGET, ZERO, CAP, r"demand 'a' has expert_bytes=-5"),
        ([VerifyDemand("a", 1, 1, skipped_ticks=-1)], BUDGET, ZERO, CAP, r"skipped_ticks=-1"),
        ([], TokensBytes(-1, 0), ZERO, CAP, r"budget\.tokens=-1 is negative"),
        ([], BUDGET, TokensBytes(0, -3), CAP, r"carried\.expert_bytes=-3 is negative"),
        ([], BUDGET, ZERO, TokensBytes(-2, 0), r"cap\.tokens=-2 is negative"),
    ],
)
def test_negative_values_anywhere_raise(demands, budget, carried, cap, match):
    with pytest.raises(ValueError, match=match):
        admit_verify_demands(demands, budget, carried, cap)


def test_negative_barrier_after_raises():
    with pytest.raises(ValueError, match=r"barrier_after=-1 is negative"):
        admit([], barrier_after=-1)


def test_inputs_are_not_mutated():
    demands = [VerifyDemand("run", 8, 40, in_flight=True)] + list(GUARD_QUEUE)
    before = copy.deepcopy(demands)
    carried = TokensBytes(3, 7)
    admit(demands, carried=carried)
    assert demands == before and carried == TokensBytes(3, 7)


def test_positional_and_keyword_construction_agree():
    assert TokensBytes(16, 80) == TokensBytes(tokens=16, expert_bytes=80)
    assert VerifyDemand("a", 8, 40) == VerifyDemand(seq_id="a", tokens=8, expert_bytes=40)


# --- single-tick properties ----------------------------------------------------------------


@st.composite
def tick_inputs(draw):
    cap = TokensBytes(draw(st.integers(0, 64)), draw(st.integers(0, 320)))
    budget = TokensBytes(draw(st.integers(0, 64)), draw(st.integers(0, 320)))
    carried = TokensBytes(draw(st.integers(0, 80)), draw(st.integers(0, 400)))
    demand = st.builds(
        VerifyDemand,
        seq_id=st.none(),
        tokens=st.integers(0, cap.tokens),
        expert_bytes=st.integers(0, cap.expert_bytes),
        in_flight=st.booleans(),
        skipped_ticks=st.integers(0, 6),
    )
    raw = draw(st.lists(demand, max_size=12))
    demands = [attrs.evolve(d, seq_id=i) for i, d in enumerate(raw)]
    return demands, budget, carried, cap, draw(st.integers(0, 5))


def _sum(ds):
    ds = list(ds)
    return sum(d.tokens for d in ds), sum(d.expert_bytes for d in ds)


@PROPS
@given(tick_inputs())
def test_admitted_sums_never_exceed_budget_plus_carried_minus_seated(inputs):
    demands, budget, carried, cap, barrier_after = inputs
    out = admit_verify_demands(demands, budget, carried, cap, barrier_after=barrier_after)
    seated_t, seated_b = _sum(d for d in demands if d.in_flight)
    adm_t, adm_b = _sum(d for d in demands if d.seq_id in out.admitted_ids)
    if out.admitted_ids:
        assert adm_t <= budget.tokens + carried.tokens - seated_t
        assert adm_b <= budget.expert_bytes + carried.expert_bytes - seated_b


@PROPS
@given(tick_inputs())
def test_carry_stays_between_zero_and_cap(inputs):
    demands, budget, carried, cap, barrier_after = inputs
    out = admit_verify_demands(demands, budget, carried, cap, barrier_after=barrier_after)
    assert 0 <= out.carried.tokens <= cap.tokens
    assert 0 <= out.carried.expert_bytes <= cap.expert_bytes


@PROPS
@given(tick_inputs())
def test_admission_is_first_fit_with_barriers_and_carries_the_clamped_rest(inputs):
    """Oracle by characterisation: every new demand is admitted iff it fits what is left at
    its position, nothing follows a non-fitting guarded demand, all in-flight are seated."""
    demands, budget, carried, cap, barrier_after = inputs
    out = admit_verify_demands(demands, budget, carried, cap, barrier_after=barrier_after)
    assert out.seated_ids == tuple(d.seq_id for d in demands if d.in_flight)
    seated_t, seated_b = _sum(d for d in demands if d.in_flight)
    pool = [budget.tokens + carried.tokens - seated_t, budget.expert_bytes + carried.expert_bytes - seated_b]
    blocked = False
    admitted = []
    for d in (d for d in demands if not d.in_flight):
        fits = d.tokens <= pool[0] and d.expert_bytes <= pool[1]
        if fits and not blocked:
            admitted.append(d.seq_id)
            pool = [pool[0] - d.tokens, pool[1] - d.expert_bytes]
        elif not fits and d.skipped_ticks >= barrier_after:
            blocked = True
    assert out.admitted_ids == tuple(admitted)
    assert out.carried == TokensBytes(min(max(pool[0], 0), cap.tokens), min(max(pool[1], 0), cap.expert_bytes))


# --- many ticks: the starvation guard ------------------------------------------------------


def ticks_to_fill(demand, budget) -> int:
    """k = max over dimensions of ceil(size / per-tick budget), at least 1."""
    k = 1
    for size, per_tick in ((demand.tokens, budget.tokens), (demand.expert_bytes, budget.expert_bytes)):
        if size:
            k = max(k, math.ceil(size / per_tick))
    return k


def simulate(arrivals, budget, cap, barrier_after, n_ticks, offer=None):
    """Run the pure function tick after tick, feeding skipped demands back with one more
    skipped tick; `offer(queue)` reorders each tick's line (the ordering policy; default
    arrival order). Returns {seq_id: (arrival_tick, admitted_tick or None, ids ahead at
    arrival)} and {seq_id: first tick it started at the head of the line already guarded}."""
    queue: list[VerifyDemand] = []
    carried = ZERO
    record, guarded_head_since = {}, {}
    for t in range(n_ticks):
        ahead = [d.seq_id for d in queue]
        for d in arrivals[t] if t < len(arrivals) else ():
            record[d.seq_id] = [t, None, tuple(ahead)]
            ahead.append(d.seq_id)
            queue.append(d)
        if offer is not None:
            queue = offer(queue)
        if queue and queue[0].skipped_ticks >= barrier_after:
            guarded_head_since.setdefault(queue[0].seq_id, t)
        out = admit_verify_demands(queue, budget, carried, cap, barrier_after=barrier_after)
        carried = out.carried
        for seq_id in out.admitted_ids:
            record[seq_id][1] = t
        admitted = set(out.admitted_ids)
        queue = [attrs.evolve(d, skipped_ticks=d.skipped_ticks + 1) for d in queue if d.seq_id not in admitted]
        queue.sort(key=lambda d: list(record).index(d.seq_id))  # back to arrival order
    return record, guarded_head_since


@st.composite
def arrival_streams(draw):
    budget = TokensBytes(draw(st.integers(1, 32)), draw(st.integers(1, 160)))
    cap = TokensBytes(draw(st.integers(1, 64)), draw(st.integers(1, 320)))
    n_ticks = draw(st.integers(1, 40))
    counter = iter(range(10**6))
    demand = st.builds(
        lambda t, b: VerifyDemand(next(counter), t, b),
        st.integers(0, cap.tokens),
        st.integers(0, cap.expert_bytes),
    )
    arrivals = draw(st.lists(st.lists(demand, max_size=3), min_size=n_ticks, max_size=n_ticks))
    return arrivals, budget, cap, draw(st.integers(0, 5)), n_ticks


@PROPS
@given(arrival_streams(), st.sampled_from(["arrival", "yield"]), st.randoms(use_true_random=False))
def test_every_demand_is_admitted_within_the_guard_bound(stream, order, rng):
    """The bound (no in-flight demands; budget > 0 in both dimensions; cap >= every demand).

    Head bound: a demand at the head of the line with skipped_ticks >= barrier_after is
    admitted within k = max_d ceil(size_d / budget_d) ticks, counting the first one. Proof:
    nothing precedes it, so when it does not fit it is a barrier and nothing is admitted;
    the pool starts >= budget (carry >= 0), and after i such ticks it is
    >= min(i * budget, budget + cap) per dimension, which covers size <= cap at i = k.

    Whole-line bound: a demand D arriving at tick a behind the set A is admitted by tick
    a + barrier_after - 1 + sum of k over A and D. From tick a + barrier_after on, D and
    every demand ahead of it (all older) carry skipped_ticks >= barrier_after, nobody new
    gets ahead of D, so the heads ahead of D leave one after another, each within its k.

    The yield ordering keeps both bounds: it offers the guarded demands first, oldest first,
    so once D is guarded only older demands are offered ahead of it, as in arrival order.
    Here every demand gets a random yield (expected tokens per byte), so the ordered line
    differs from the arrival line from tick to tick.
    """
    arrivals, budget, cap, barrier_after, n_ticks = stream
    yields = {d.seq_id: rng.random() for tick in arrivals for d in tick}

    def offer(queue):
        keys = [
            OrderKey(seq_id=d.seq_id, expected_tokens=yields[d.seq_id], alone_bytes=1, skipped_ticks=d.skipped_ticks)
            for d in queue
        ]
        return [queue[i] for i in offer_order(keys, order, barrier_after)]

    record, guarded_head_since = simulate(arrivals, budget, cap, barrier_after, n_ticks, offer)
    by_id = {d.seq_id: d for tick in arrivals for d in tick}
    for seq_id, (arrived, admitted_at, ahead) in record.items():
        k_sum = sum(ticks_to_fill(by_id[j], budget) for j in (*ahead, seq_id))
        deadline = arrived + barrier_after - 1 + k_sum
        if admitted_at is None:  # still waiting when the run stopped: not yet overdue
            assert n_ticks - 1 < deadline, (seq_id, arrived, deadline)
        else:
            assert admitted_at <= deadline, (seq_id, arrived, admitted_at, deadline)
        if seq_id in guarded_head_since:
            head_deadline = guarded_head_since[seq_id] + ticks_to_fill(by_id[seq_id], budget) - 1
            if admitted_at is None:
                assert n_ticks - 1 < head_deadline
            else:
                assert admitted_at <= head_deadline


def steady_stream_behind_a_large_demand(n_ticks):
    """A (24,120) demand, then two (8,40) demands each tick: together they fill (16,80)."""
    counter = iter(range(10**6))
    arrivals = [[VerifyDemand(f"small{next(counter)}", 8, 40) for _ in range(2)] for _ in range(n_ticks)]
    arrivals[0].insert(0, VerifyDemand("large", 24, 120))
    return arrivals


def test_the_guard_admits_a_large_demand_behind_a_steady_stream():
    # Skipped at ticks 0..3 (the small ones fill each tick); a barrier at tick 4 (carry
    # (16,80)); admitted at tick 5 on a (32,160) pool: 4 + ceil(24/16) ticks.
    record, _ = simulate(steady_stream_behind_a_large_demand(200), BUDGET, CAP, 4, 200)
    assert record["large"][1] == 5


def test_without_the_guard_the_same_stream_starves_the_large_demand():
    record, _ = simulate(steady_stream_behind_a_large_demand(200), BUDGET, CAP, 10**9, 200)
    assert record["large"][1] is None
    assert all(r[1] is not None for seq_id, r in record.items() if seq_id != "large")


# --- which bytes a demand is charged -------------------------------------------------------


class Pending:
    def __init__(self, union, byte_map, fetch_bytes=0):
        self.union = frozenset(union)
        self.full_bytes = sum(byte_map[e] for e in self.union)
        self.fetch_bytes = fetch_bytes


BYTE_MAP = {(layer, e): 10 * (layer + 1) + e for layer in range(3) for e in range(4)}


def test_marginal_charges_only_what_each_union_adds_in_order():
    a = Pending({(0, 0), (0, 1), (1, 2)}, BYTE_MAP, fetch_bytes=5)
    b = Pending({(0, 1), (1, 2), (2, 3)}, BYTE_MAP, fetch_bytes=6)
    resident, in_flight = {(0, 0)}, {(2, 3)}
    assert charge_bytes([a, b], "marginal", BYTE_MAP, resident, in_flight) == [
        BYTE_MAP[(0, 1)] + BYTE_MAP[(1, 2)],
        0,  # (0,1) and (1,2) charged to a, (2,3) already coming
    ]
    assert charge_bytes([a, b], ChargeMode.FULL, BYTE_MAP, resident, in_flight) == [a.full_bytes, b.full_bytes]
    assert charge_bytes([a, b], "fetch", None, resident, in_flight) == [5, 6]


def test_marginal_charging_needs_the_byte_map():
    with pytest.raises(ValueError, match="byte_map=None"):
        charge_bytes([], "marginal", None, set(), set())


experts = st.tuples(st.integers(0, 2), st.integers(0, 3))


@PROPS
@given(st.lists(st.frozensets(experts), max_size=8), st.frozensets(experts), st.frozensets(experts))
def test_marginal_charges_sum_to_the_bytes_of_the_new_union(unions, resident, in_flight):
    pending = [Pending(u, BYTE_MAP) for u in unions]
    charges = charge_bytes(pending, ChargeMode.MARGINAL, BYTE_MAP, resident, in_flight)
    new = frozenset().union(*unions) - resident - in_flight
    assert sum(charges) == sum(BYTE_MAP[e] for e in new)
    assert all(0 <= c <= p.full_bytes for c, p in zip(charges, pending))


@pytest.mark.parametrize("size", [0, 10, ExpertMasks.SMALL + 1, 300])  # both ways of building a mask
def test_expert_masks_sum_the_byte_map_over_any_union(size):
    byte_map = {(layer, e): 100 + 7 * (e % 2) for layer in range(5) for e in range(128)}  # two expert sizes
    rng = random.Random(size)
    union = rng.sample(sorted(byte_map), size)
    masks = ExpertMasks(byte_map)
    assert masks.nbytes(masks.mask(union)) == sum(byte_map[e] for e in union)
    half = len(union) // 2
    assert masks.mask(union) == masks.mask(union[:half]) | masks.mask(union[half:])
    with pytest.raises(KeyError):
        masks.mask([*union, (9, 9)])


def test_charge_mode_defaults_to_marginal():
    sched = VerifyScheduler(token_budget=16, token_cap=32, byte_budget=80, byte_cap=160, byte_map={(0, 0): 80})
    assert sched.charge_mode is ChargeMode.MARGINAL


def test_a_marginal_scheduler_without_its_byte_map_is_refused_at_construction():
    with pytest.raises(ValueError, match="charge mode 'marginal' needs the byte map; got byte_map=None"):
        VerifyScheduler(token_budget=16, token_cap=32, byte_budget=80, byte_cap=160)


# --- the scheduler -------------------------------------------------------------------------


def two_d(**kw) -> VerifyScheduler:
    config = dict(token_budget=16, token_cap=32, byte_budget=80, byte_cap=160, charge_mode="full")
    return VerifyScheduler(**(config | kw))


@pytest.mark.asyncio
async def test_waiters_are_woken_in_admission_order():
    sched = two_d()
    tickets = {s: sched.register(s, 8, full_bytes=40) for s in "abc"}
    woken = []

    async def waiter(s):
        await tickets[s].wait()
        woken.append(s)

    async with anyio.create_task_group() as tg:
        for s in "cba":  # start waiting in reverse: wake order must come from admission
            tg.start_soon(waiter, s)
        await anyio.wait_all_tasks_blocked()
        assert sched.tick().admitted_ids == ("a", "b")
        await anyio.wait_all_tasks_blocked()
        assert woken == ["a", "b"] and sched.pending_count() == 1
        sched.finish("a")
        sched.finish("b")
        assert sched.tick().admitted_ids == ("c",)
    assert woken == ["a", "b", "c"]


@pytest.mark.asyncio
async def test_a_cancelled_waiter_removes_its_demand_and_the_others_are_admitted():
    sched = two_d()
    big = sched.register("big", 24, full_bytes=120)
    small = sched.register("small", 8, full_bytes=40)
    async with anyio.create_task_group() as tg:
        tg.start_soon(big.wait)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert sched.pending_count() == 1
    sched.tick()
    assert small.admitted and sched.pending_count() == 0


@pytest.mark.asyncio
async def test_cancelling_a_barrier_hands_its_saved_pool_to_the_demands_behind_it():
    sched = two_d(barrier_after=0)
    big = sched.register("big", 24, full_bytes=120)
    small = sched.register("small", 8, full_bytes=40)
    assert sched.tick().admitted_ids == ()  # big is a barrier at once
    with anyio.move_on_after(0.01):
        await big.wait()
    assert small.admitted, "re-assignment must not wait for the next tick"
    assert sched.pending_count() == 0 and sched.carried == TokensBytes(8, 40)


@pytest.mark.asyncio
async def test_a_waiter_cancelled_just_after_admission_gives_its_share_back():
    sched = two_d()
    first = sched.register("first", 16, full_bytes=80)
    second = sched.register("second", 16, full_bytes=80)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.wait)
        await anyio.wait_all_tasks_blocked()
        assert sched.tick().admitted_ids == ("first",)
        tg.cancel_scope.cancel()  # before the woken waiter ran again
    assert sched.pending_count() == 0 and second.admitted
    assert sched.carried == ZERO  # first's 16 tokens went back to the pool, then to second


def test_cancelling_an_admitted_verify_before_it_runs_refunds_this_ticks_pool():
    sched = two_d()
    sched.register("first", 16, full_bytes=80)
    second = sched.register("second", 8, full_bytes=40)
    assert sched.tick().admitted_ids == ("first",)
    assert sched.cancel("first")  # the engine's abort path
    assert second.admitted and sched.carried == TokensBytes(8, 40)


def test_cancel_of_a_waiting_demand_wakes_its_waiter_with_admission_cancelled():
    async def main():
        sched = two_d()
        ticket = sched.register("a", 8, full_bytes=40)
        assert sched.cancel("a") and not sched.cancel("a")
        with pytest.raises(AdmissionCancelled, match="'a'"):
            await ticket.wait()
        assert sched.pending_count() == 0

    anyio.run(main)


def test_a_re_registered_demand_keeps_its_place_and_its_ticket():
    sched = two_d()
    a = sched.register("a", 24, full_bytes=120)
    sched.register("b", 8, full_bytes=40)
    assert sched.register("a", 16, full_bytes=80) is a  # re-drafted smaller
    assert sched.tick().admitted_ids == ("a",)


def test_a_demand_marked_in_flight_is_seated_until_finish():
    sched = two_d()
    sched.register("a", 8, full_bytes=40)
    assert sched.tick().admitted_ids == ("a",)
    sched.mark_in_flight("a")
    with pytest.raises(ValueError, match="finish"):
        sched.register("a", 8)
    # pool = (16,80) + carried (8,40) - seated (8,40)
    assert sched.tick() == VerifyAdmission(("a",), (), TokensBytes(16, 80))
    sched.finish("a")
    assert sched.tick().seated_ids == ()
    with pytest.raises(KeyError, match="'a'"):
        sched.finish("a")


def test_marginal_mode_charges_shared_experts_once_per_tick():
    byte_map = {(0, e): 40 for e in range(8)}
    sched = two_d(charge_mode="marginal", byte_map=byte_map)
    for s in "abc":  # same union: only the first pays its 80 bytes
        sched.register(s, 4, union={(0, 0), (0, 1)}, full_bytes=80)
    out = sched.tick(resident=set(), in_flight_union=set())
    assert out.admitted_ids == ("a", "b", "c") and out.carried == TokensBytes(4, 0)


def test_marginal_charge_follows_a_re_registered_union():
    byte_map = {(0, e): 40 for e in range(8)} | {(1, e): 25 for e in range(8)}  # two expert sizes
    sched = two_d(charge_mode="marginal", byte_map=byte_map)
    sched.register("a", 4, union={(0, e) for e in range(4)}, full_bytes=160)  # 160 > 80 + carried
    assert sched.tick(resident=set(), in_flight_union=set()).admitted_ids == ()
    sched.register("a", 4, union={(0, 0), (1, 0), (1, 1)}, full_bytes=90)  # re-drafted: 40 of it resident
    out = sched.tick(resident={(0, 0)}, in_flight_union=set())
    assert out.admitted_ids == ("a",) and sched.stats().admitted == 1
    assert sched._admitted["a"].charge == TokensBytes(4, 50)


@pytest.mark.asyncio
async def test_token_only_mode_ignores_bytes():
    sched = VerifyScheduler(token_budget=16, token_cap=32)
    tickets = [sched.register(s, 8, union={(0, 1)}, full_bytes=10**12, fetch_bytes=10**12) for s in "ab"]
    out = sched.tick(resident=set(), in_flight_union=set())
    assert out.admitted_ids == ("a", "b") and out.carried == ZERO
    for t in tickets:
        await t.wait()


def test_stats_report_ticks_admissions_and_wait_percentiles():
    now = [0.0]
    sched = two_d(clock=lambda: now[0])
    for s in "abc":
        sched.register(s, 8, full_bytes=40)
    now[0] = 1.0
    sched.tick()  # a, b waited 1 s
    now[0] = 3.0
    sched.finish("a"), sched.finish("b")
    sched.tick()  # c waited 3 s
    stats = sched.stats()
    assert (stats.ticks, stats.admitted, stats.pending) == (2, 3, 0)
    assert (stats.wait_p50_s, stats.wait_p99_s, stats.last_tick_s) == (1.0, 3.0, 0.0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(byte_budget=80), r"byte_budget and byte_cap go together.*byte_cap=None"),
        (dict(byte_cap=160), r"byte_budget=None, byte_cap=160"),
        (dict(token_budget=0), r"token_budget=0 is invalid: it must be an int >= 1"),
        (dict(token_cap=-1), r"token_cap=-1 is invalid"),
        (dict(byte_budget=0, byte_cap=160), r"byte_budget=0 is invalid"),
        (dict(byte_budget=80, byte_cap=-1), r"byte_cap=-1 is invalid"),
        (dict(barrier_after=-1), r"barrier_after=-1 is invalid"),
        (dict(token_budget=1.5), r"token_budget=1.5 is invalid"),
        (dict(charge_mode="bogus"), r"charge_mode='bogus' is not one of 'full', 'fetch', 'marginal'"),
    ],
)
def test_bad_configurations_raise_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        VerifyScheduler(**(dict(token_budget=16, token_cap=32) | kw))


def test_a_token_cap_below_one_block_is_rejected():
    sched = VerifyScheduler(token_budget=16, token_cap=4)
    with pytest.raises(ValueError, match=r"token_cap=4 is smaller than one verify block of 8 tokens"):
        sched.validate_block(8)
    VerifyScheduler(token_budget=4, token_cap=8).validate_block(8)


@pytest.mark.parametrize(
    "args, match",
    [
        (("a", 40), r"token_cap=32 is smaller than the tokens of the verify of sequence 'a' \(40\)"),
        (("a", 8, (), 200, 0), r"byte_cap=160 is smaller than the bytes .* may be charged \(200\)"),
        (("a", 8, (), 10, 20), r"fetch_bytes=20 exceeds full_bytes=10"),
        (("a", -1), r"tokens=-1 is invalid"),
    ],
)
def test_demands_that_could_never_be_admitted_are_rejected_at_register(args, match):
    with pytest.raises(ValueError, match=match):
        two_d().register(*args)


# --- the ordering policy -------------------------------------------------------------------


def test_yield_order_offers_the_most_tokens_per_byte_first():
    byte_map = {(0, e): 40 for e in range(8)}
    for order, admitted in (("arrival", ("poor",)), ("yield", ("rich",))):
        sched = two_d(charge_mode="marginal", byte_map=byte_map, order=order)
        sched.register("poor", 4, union={(0, 0), (0, 1)}, full_bytes=80, expected_tokens=1.0)
        sched.register("rich", 4, union={(0, 2), (0, 3)}, full_bytes=80, expected_tokens=3.5)
        assert sched.tick(resident=set(), in_flight_union=set()).admitted_ids == admitted, order


def test_yield_counts_only_what_is_not_resident_or_coming():
    byte_map = {(0, e): 40 for e in range(8)}
    sched = two_d(charge_mode="marginal", byte_map=byte_map, order="yield")
    sched.register("fresh", 4, union={(0, 0), (0, 1)}, full_bytes=80, expected_tokens=3.0)
    sched.register("cached", 4, union={(0, 2), (0, 3)}, full_bytes=80, expected_tokens=1.5)  # half resident
    assert sched.tick(resident={(0, 2)}, in_flight_union={(0, 3)}).admitted_ids == ("cached", "fresh")


def test_a_guarded_demand_is_offered_before_a_better_yield():
    keys = [
        OrderKey(seq_id="old", expected_tokens=1.0, alone_bytes=100, skipped_ticks=4),
        OrderKey(seq_id="new", expected_tokens=5.0, alone_bytes=10, skipped_ticks=0),
        OrderKey(seq_id="free", expected_tokens=1.0, alone_bytes=0, skipped_ticks=0),
    ]
    assert offer_order(keys, "yield", barrier_after=4) == [0, 2, 1]
    assert offer_order(keys, "arrival", barrier_after=4) == [0, 1, 2]
    with pytest.raises(ValueError, match="order='best'"):
        offer_order(keys, "best", barrier_after=4)


def test_equal_yields_keep_arrival_order():
    """Ties (equal tokens per byte, or several demands that add no bytes) are offered oldest first."""
    keys = [
        OrderKey(seq_id="a", expected_tokens=1.0, alone_bytes=10, skipped_ticks=0),
        OrderKey(seq_id="b", expected_tokens=2.0, alone_bytes=20, skipped_ticks=0),
        OrderKey(seq_id="c", expected_tokens=1.0, alone_bytes=0, skipped_ticks=0),
        OrderKey(seq_id="d", expected_tokens=3.0, alone_bytes=0, skipped_ticks=0),
        OrderKey(seq_id="e", expected_tokens=1.0, alone_bytes=5, skipped_ticks=0),
    ]
    assert offer_order(keys, "yield", barrier_after=4) == [2, 3, 4, 0, 1]


def test_yield_ranks_only_the_oldest_look_ahead_and_keeps_arrival_order_behind_them():
    """The best yield behind the window waits its turn; within the window yield decides."""
    n = LOOK_AHEAD + 2
    keys = [OrderKey(seq_id=i, expected_tokens=1.0 + i, alone_bytes=10, skipped_ticks=0) for i in range(n)]
    assert offer_order(keys, "yield", barrier_after=4) == [*range(LOOK_AHEAD - 1, -1, -1), LOOK_AHEAD, LOOK_AHEAD + 1]
    byte_map = {(0, e): 40 for e in range(n)}
    sched = two_d(charge_mode="marginal", byte_map=byte_map, order="yield", byte_budget=16 * 40, byte_cap=32 * 40)
    for i in range(n):  # one token and one expert each: a tick's 16 tokens admit the 16 best ranked
        sched.register(i, 1, union={(0, i)}, full_bytes=40, expected_tokens=1.0 + i)
    best_ranked = tuple(range(LOOK_AHEAD - 1, LOOK_AHEAD - 17, -1))
    assert sched.tick(resident=set(), in_flight_union=set()).admitted_ids == best_ranked


EVERY_EXPERT = dict(byte_budget=8 * 40, byte_cap=8 * 40)  # every expert's bytes of an 8-expert map


def test_when_every_waiting_demand_fits_the_yield_order_is_not_computed(monkeypatch):
    """A pool of every expert's bytes and every waiting token admits them all in any order (the
    derived budgets' every tick): the tick neither ranks nor charges them; one token short, it
    ranks again."""
    byte_map = {(0, e): 40 for e in range(8)}
    for tokens_short, admitted in ((0, ("poor", "rich")), (1, ("rich",))):
        sched = two_d(
            charge_mode="marginal", byte_map=byte_map, order="yield", token_budget=8 - tokens_short, **EVERY_EXPERT
        )
        ranked = []
        alone = sched._table.alone_bytes
        monkeypatch.setattr(
            sched._table, "alone_bytes", lambda *a, ranked=ranked, alone=alone: ranked.append(a) or alone(*a)
        )
        sched.register("poor", 4, union={(0, 0), (0, 1)}, full_bytes=80, expected_tokens=1.0)
        sched.register("rich", 4, union={(0, 2), (0, 3)}, full_bytes=80, expected_tokens=3.5)
        assert sched.tick(resident=set(), in_flight_union=set()).admitted_ids == admitted
        assert bool(ranked) == bool(tokens_short)


@pytest.mark.asyncio
async def test_a_tick_in_which_all_fit_hands_out_the_queue_as_a_binding_tick_would():
    """The whole queue handed over at once (every demand fits) wakes the waiters in arrival order,
    counts the admissions and their waits, and an admission of this tick cancelled before it
    runs still refunds its tokens, which re-assignment gives to a demand registered since."""
    byte_map = {(0, e): 40 for e in range(8)}
    sched = two_d(charge_mode="marginal", byte_map=byte_map, order="yield", token_budget=12, **EVERY_EXPERT)
    tickets = {s: sched.register(s, 4, union={(0, i)}, full_bytes=40) for i, s in enumerate("abc")}
    woken = []

    async def waiter(s):
        await tickets[s].wait()
        woken.append(s)

    async with anyio.create_task_group() as tg:
        for s in "cba":
            tg.start_soon(waiter, s)
        await anyio.wait_all_tasks_blocked()
        out = sched.tick(resident=set(), in_flight_union=set())
        await anyio.wait_all_tasks_blocked()
    assert out.admitted_ids == ("a", "b", "c") and woken == ["a", "b", "c"]
    stats = sched.stats()
    assert (stats.admitted, stats.pending, stats.ticks) == (3, 0, 1) and stats.wait_p99_s is not None
    assert sched.admitted_ids() == ["a", "b", "c"] and sched.carried == TokensBytes(0, 8 * 40)
    late = sched.register("late", 4, union={(0, 5)}, full_bytes=40)
    assert not late.admitted
    assert sched.cancel("b")  # admitted by this tick, not yet running: its 4 tokens come back
    assert late.admitted and sched.admitted_ids() == ["a", "c", "late"]


def test_after_a_tick_that_read_no_union_a_mask_waits_until_a_tick_reads_it():
    """Registrations after an all-fitting tick defer their union's mask; a tick whose budget then
    binds builds it on reading and charges the marginal bytes all the same."""
    byte_map = {(0, e): 40 for e in range(8)}
    sched = two_d(charge_mode="marginal", byte_map=byte_map, order="arrival", byte_budget=8 * 40, byte_cap=80)
    sched.register("first", 4, union={(0, 0)}, full_bytes=40)
    assert sched.tick(resident=set(), in_flight_union=set()).admitted_ids == ("first",)
    sched.finish("first")
    sched.register("a", 4, union={(0, 1), (0, 2)}, full_bytes=80)
    sched.register("b", 4, union={(0, 2), (0, 3)}, full_bytes=80)
    assert sched._table._masks_of[sched._queue["a"].slot] is None  # not built yet
    # the all-fitting tick charged nothing and carried its bytes up to the cap, 80; with no new
    # budget that is the pool: a's two experts fit, then b's one more ((0, 2) is a's) does not
    out = sched.tick(resident={(0, 0)}, in_flight_union=set(), budget=TokensBytes(16, 0))
    assert out.admitted_ids == ("a",) and sched._admitted["a"].charged_bytes == 80
