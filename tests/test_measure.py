"""Measurement helpers against closed forms: the busy time of several timelines is the length
of the union of their intervals."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.measure import BusyClock

intervals = st.lists(st.tuples(st.integers(0, 100), st.integers(1, 30)).map(lambda p: (p[0], p[0] + p[1])), max_size=12)


def union_length(spans):
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_busy_clock_counts_the_union_of_overlapping_activities(spans):
    clock = BusyClock()
    events = sorted([(s, 1) for s, _ in spans] + [(e, 0) for _, e in spans])  # a leave before an enter at one instant
    for at, entering in events:
        (clock.enter if entering else clock.leave)(float(at))
    assert clock.busy_s(1000.0) == union_length(spans)


def test_an_open_stretch_counts_up_to_now():
    clock = BusyClock()
    clock.enter(1.0)
    clock.enter(2.0)
    clock.leave(3.0)
    assert clock.busy_s(5.0) == 4.0
