"""What a tick computes only as far as it reads: first-fit pulled one demand at a time and
stopped once nothing more can fit, marginal charges counted one union at a time over int
masks, the resident row read as the slot table's own bitmask, and expert bits by arithmetic
on a grid byte map; each against its plain definition."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.admission import first_fit_stream
from pdflash.engine.charging import ExpertMasks, MarginalCounter, TrackedRow
from pdflash.offload.slot_table import Entry, SlotTable

PROPS = settings(max_examples=200, deadline=None)


def first_fit_reading_everything(line, pool_tokens, pool_bytes, barrier_after):
    """First-fit by its definition: every demand looked at, in order, up to a barrier."""
    admitted = []
    for i, (tokens, expert_bytes, skipped) in enumerate(line):
        if tokens <= pool_tokens and expert_bytes <= pool_bytes:
            admitted.append(i)
            pool_tokens -= tokens
            pool_bytes -= expert_bytes
        elif skipped >= barrier_after:
            break
    return admitted, pool_tokens, pool_bytes


LINES = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30), st.integers(0, 5)), max_size=30)


@PROPS
@given(LINES, st.integers(-2, 16), st.integers(-10, 100), st.integers(0, 4))
def test_first_fit_stops_pulling_only_where_nothing_more_can_fit(line, pool_tokens, pool_bytes, barrier_after):
    pulled = []

    def pull():
        for demand in line:
            pulled.append(demand)
            yield demand

    fewest = min((t for t, _, _ in line), default=0)  # zero-token demands included: they always fit by tokens
    got = first_fit_stream(pull(), pool_tokens, pool_bytes, barrier_after, fewest)
    assert got == first_fit_reading_everything(line, pool_tokens, pool_bytes, barrier_after)
    left_tokens, left_bytes = got[1], got[2]
    if len(pulled) < len(line) and not (pulled and pulled[-1][2] >= barrier_after):  # stopped, not at a barrier
        assert left_tokens < fewest or left_bytes < 0  # ... because nothing left could fit
    if line and pool_tokens >= fewest and pool_bytes >= 0:
        assert pulled  # it looks when something might fit


def test_a_spent_pool_reads_no_charge_at_all():
    def never():
        raise AssertionError("a charge was counted for a tick that cannot admit")
        yield (1, 1, 0)

    assert first_fit_stream(never(), 3, 100, 4, fewest_tokens=4) == ([], 3, 100)
    assert first_fit_stream(never(), 8, -1, 4, fewest_tokens=0) == ([], 8, -1)


BYTE_MAP = {(layer, e): 10 + 5 * (e % 3) for layer in range(3) for e in range(40)}  # three sizes
EXPERT = st.sampled_from(sorted(BYTE_MAP))


@PROPS
@given(st.frozensets(EXPERT), st.lists(st.frozensets(EXPERT), max_size=12), st.booleans())
def test_counting_one_union_at_a_time_equals_the_set_differences(covered, unions, one_size):
    byte_map = dict.fromkeys(BYTE_MAP, 7) if one_size else BYTE_MAP
    masks = ExpertMasks(byte_map)
    counter = MarginalCounter(masks, masks.mask(covered))
    seen, expected = set(covered), []
    for union in unions:
        expected.append(sum(byte_map[e] for e in union - seen))
        seen |= union
    assert [counter(masks.mask(u)) for u in unions] == expected


@pytest.mark.parametrize("first_layer", [0, 2])
def test_a_tracked_row_reads_the_slot_table_mask_as_the_set(first_layer):
    """Snapshots of a slot table whose experts come and go (including layers the byte map
    lacks, which no union can name), mixed with plain sets: every mask is the mask of the
    snapshot's experts in the byte map."""
    byte_map = {(layer, e): 10 + 5 * (e % 3) for layer in range(first_layer, first_layer + 3) for e in range(40)}
    rng = random.Random(3)
    keys = [(layer, e) for layer in range(first_layer + 4) for e in range(40)]  # one more layer each side
    masks = ExpertMasks(byte_map)
    assert masks.grid == (40, first_layer)
    table, tracked = SlotTable(60, 40), TrackedRow(masks)
    for step in range(40):
        for _ in range(rng.randrange(12)):
            if table.entries and (rng.random() < 0.5 or table.occupied == table.num_slots):
                table.remove(table.entries[rng.choice(sorted(table.entries))])
            else:
                key = rng.choice([k for k in keys if k not in table.entries])
                table.add(Entry(key, table.take_free(), 1, 0.0))
        snapshot = table.resident()
        assert snapshot == frozenset(table.entries)
        in_map = frozenset(k for k in snapshot if k in byte_map)
        if step % 7 == 3:  # now and then a plain set, compared with the last one
            assert tracked.mask_of(in_map) == masks.mask(in_map)
        assert tracked.mask_of(snapshot) == masks.mask(in_map)
        assert (tracked.of(snapshot) == masks.row_of(in_map)).all()
    assert tracked.mask_of(frozenset()) == 0  # an empty plain set after a snapshot


def test_a_table_numbered_otherwise_is_read_key_by_key():
    byte_map = {(0, e): 1 for e in range(8)}
    table, tracked = SlotTable(4, 16), TrackedRow(ExpertMasks(byte_map))  # 16 experts a layer: not the map's 8
    table.add(Entry((0, 3), table.take_free(), 1, 0.0))
    assert tracked.mask_of(table.resident()) == 1 << 3
    table.add(Entry((0, 12), table.take_free(), 1, 0.0))
    with pytest.raises(KeyError):  # an expert the byte map lacks, found key by key
        tracked.mask_of(table.resident())


def test_a_slot_table_refuses_a_key_off_its_grid():
    table = SlotTable(4, 8)
    for key in ((0, 8), (0, -1), (-1, 0)):
        with pytest.raises(ValueError, match="is not a"):
            table.add(Entry(key, 0, 1, 0.0))
    assert table.entries == {} and table.resident().mask == 0


def test_a_grid_byte_map_numbers_its_experts_by_arithmetic_as_its_dict_does():
    grid = {(layer, e): 1 for layer in range(2, 6) for e in range(16)}  # layers need not start at 0
    masks = ExpertMasks(grid)
    assert masks.grid == (16, 2)
    experts = [(5, 15), (2, 0), (3, 7)]
    assert list(masks.bits(experts)) == [list(grid).index(k) for k in experts]
    for unknown in ((1, 0), (6, 0), (2, 16), (2, -1)):
        with pytest.raises(KeyError):
            masks.bits([(2, 0), unknown])
    shuffled = dict(sorted(grid.items(), key=lambda kv: -kv[0][1]))
    holed = {k: v for k, v in grid.items() if k != (3, 3)}
    for not_a_grid in (shuffled, holed, {("a", 0): 1}, {(0, 0, 0): 1}):
        m = ExpertMasks(not_a_grid)
        assert m.grid is None
        assert list(m.bits(list(not_a_grid)[:3])) == list(range(min(3, len(not_a_grid))))
