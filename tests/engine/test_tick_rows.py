"""The vectorized tick against its set-based definition: expert rows (packed words, popcount
sums), the tracked resident row, and whole `VerifyScheduler` ticks replayed through the pure
functions over plain Python sets (charges by set difference, the yield order by its sort key)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.admission import TokensBytes, VerifyDemand, admit_verify_demands
from pdflash.engine.charging import ExpertMasks, TrackedRow, UnionOf
from pdflash.engine.ordering import LOOK_AHEAD
from pdflash.engine.scheduler import VerifyScheduler

PROPS = settings(max_examples=150, deadline=None)


def qwen_like(layers: int, two_sizes: bool) -> dict:
    return {(layer, e): 9_437_184 + (7 * (e % 2) if two_sizes else 0) for layer in range(layers) for e in range(128)}


@PROPS
@given(st.integers(1, 48), st.booleans(), st.data())
def test_rows_sum_the_byte_map_over_any_sets_of_experts(layers, two_sizes, data):
    byte_map = qwen_like(layers, two_sizes)
    keys = sorted(byte_map)
    sets = data.draw(st.lists(st.sets(st.sampled_from(keys)), max_size=5))
    sets += [set(keys), set()]  # every expert: the largest popcount a row can hold
    masks = ExpertMasks(byte_map)
    rows = np.stack([masks.row_of(s) for s in sets])
    assert masks.row_bytes(rows).tolist() == [sum(byte_map[e] for e in s) for s in sets]
    assert all((masks.row_of(s) == masks.row(masks.mask(s))).all() for s in sets)


@PROPS
@given(st.lists(st.frozensets(st.tuples(st.integers(0, 2), st.integers(0, 127))), min_size=1, max_size=8))
def test_a_tracked_row_follows_a_drifting_set(sets):
    masks = ExpertMasks(qwen_like(3, False))
    tracked = TrackedRow(masks)
    for s in sets:
        assert (tracked.of(s) == masks.row_of(s)).all()
        assert (tracked.of(set(s)) == masks.row_of(s)).all()  # a plain set too


BYTE_MAP = {(layer, e): 10 + 5 * (e % 2) for layer in range(3) for e in range(8)}  # two sizes
EXPERT = st.tuples(st.integers(0, 2), st.integers(0, 7))


@st.composite
def tick_streams(draw):
    order = draw(st.sampled_from(["arrival", "yield"]))
    mode = draw(st.sampled_from(["marginal", "full", "fetch"]))
    ticks = []
    for _ in range(draw(st.integers(1, 6))):
        registrations = draw(
            st.lists(
                st.tuples(st.integers(0, 9), st.integers(1, 8), st.frozensets(EXPERT, max_size=6), st.integers(1, 5)),
                max_size=6,
            )
        )
        resident = draw(st.frozensets(EXPERT, max_size=10))
        ticks.append((registrations, resident, draw(st.booleans())))
    budget = (draw(st.integers(1, 16)), draw(st.integers(1, 60)))
    return order, mode, budget, ticks


def reference_line(order, waiting, skipped, resident, in_flight, barrier_after):
    """The waiting requests in offer order, by the ordering's definition over plain sets."""
    if order == "arrival":
        return list(waiting)

    def per_byte(r):
        alone = sum(BYTE_MAP[e] for e in r.union - resident - in_flight)
        return r.expected_tokens / alone if alone else math.inf

    guarded = [r for r in waiting if skipped[r.seq_id] >= barrier_after]
    rest = [r for r in waiting if skipped[r.seq_id] < barrier_after]
    ranked = sorted(rest[:LOOK_AHEAD], key=lambda r: -per_byte(r))  # sorted is stable: ties in arrival order
    return guarded + ranked + rest[LOOK_AHEAD:]


def reference_charges(mode, line, resident, in_flight):
    if mode == "full":
        return [r.full_bytes for r in line]
    if mode == "fetch":
        return [r.fetch_bytes for r in line]
    covered, charges = set(resident) | set(in_flight), []
    for r in line:
        new = r.union - covered
        charges.append(sum(BYTE_MAP[e] for e in new))
        covered |= new
    return charges


@PROPS
@given(tick_streams())
def test_every_tick_equals_the_pure_functions_over_plain_sets(stream):
    """Registrations (new and re-registered), admitted verifies seated the next tick with
    their unions in flight (as a UnionOf of the registered unions, or one plain set), a
    drifting resident set: each tick admits, seats and carries what the definitions say."""
    order, mode, (token_budget, byte_budget), ticks = stream
    cap = TokensBytes(32, 200)
    sched = VerifyScheduler(
        token_budget=token_budget,
        token_cap=cap.tokens,
        byte_budget=byte_budget,
        byte_cap=cap.expert_bytes,
        charge_mode=mode,
        byte_map=BYTE_MAP,
        order=order,
        barrier_after=2,
    )
    queue: dict = {}  # seq_id -> request, arrival order (the model)
    skipped: dict = {}
    seated: list = []  # requests in flight
    carried = TokensBytes(0, 0)
    for registrations, resident, as_parts in ticks:
        seated_ids = {r.seq_id for r in seated}
        for seq_id, tokens, union, expected in registrations:
            if seq_id in seated_ids:
                continue  # it has a verify in flight
            full = sum(BYTE_MAP[e] for e in union)
            sched.register(seq_id, tokens, union, full, full // 2, expected_tokens=expected)
            queue[seq_id] = sched._queue[seq_id].request  # the registered object (its union included)
            skipped.setdefault(seq_id, 0)
        in_flight_set = frozenset().union(*(r.union for r in seated))
        in_flight = UnionOf(r.union for r in seated) if as_parts else in_flight_set

        line = reference_line(order, list(queue.values()), skipped, resident, in_flight_set, 2)
        charges = reference_charges(mode, seated + line, resident, in_flight_set)
        demands = [VerifyDemand(r.seq_id, r.tokens, c, in_flight=True) for r, c in zip(seated, charges)]
        demands += [
            VerifyDemand(r.seq_id, r.tokens, c, skipped_ticks=skipped[r.seq_id])
            for r, c in zip(line, charges[len(seated) :])
        ]
        expected_out = admit_verify_demands(demands, sched.budget, carried, cap, barrier_after=2)

        out = sched.tick(resident, in_flight)
        assert out == expected_out
        carried = out.carried
        for r in seated:  # the running batch ends, the admitted one starts
            sched.finish(r.seq_id)
        seated = [queue.pop(seq_id) for seq_id in out.admitted_ids]
        for seq_id in out.admitted_ids:
            del skipped[seq_id]
            sched.mark_in_flight(seq_id)
        for seq_id in queue:
            skipped[seq_id] += 1


def test_one_union_object_registered_by_two_demands_is_charged_and_forgotten_cleanly():
    byte_map = {(0, e): 10 for e in range(8)}
    shared = frozenset({(0, 0), (0, 1)})
    sched = VerifyScheduler(token_budget=8, token_cap=8, byte_budget=20, byte_cap=40, byte_map=byte_map)
    sched.register("a", 4, shared, 20)
    sched.register("b", 4, shared, 20)
    assert sched.tick(frozenset(), frozenset()).admitted_ids == ("a", "b")  # b's experts come with a's
    sched.mark_in_flight("a")
    sched.mark_in_flight("b")
    sched.finish("b")
    sched.finish("a")  # the second of two owners of one union object leaves too
    sched.register("c", 4, frozenset({(0, 2), (0, 3)}), 20)
    sched.register("d", 4, frozenset({(0, 2), (0, 4)}), 20)
    out = sched.tick(frozenset(), UnionOf([shared]))  # a part no demand holds any more: built afresh
    assert out.admitted_ids == ("c",) and out.carried == TokensBytes(4, 0)  # d would add (0, 4): 10 > 0 left
