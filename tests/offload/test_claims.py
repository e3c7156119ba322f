"""Claims and what they order: the victim a slot table gives up, and the keys a prefetch fetches next."""

from __future__ import annotations

from pdflash.offload.slot_table import PASSED, Entry, EntryState, SlotTable, WantedKeys, pass_claims


def test_victims_are_unclaimed_first_then_the_claimed_needed_last():
    table = SlotTable(4, experts_per_layer=8)
    entries = {}
    for key in [(0, 0), (1, 0), (2, 0), (3, 0)]:
        slot = table.take_free()
        assert slot is not None
        entries[key] = Entry(key=key, slot=slot, nbytes=1, requested_at=0.0, state=EntryState.READY)
        table.add(entries[key])
    table.claim([(0, 0), (3, 0)], order=5)
    table.claim([(1, 0)], order=7)
    table.claim([(3, 0)], order=8)

    def victim(needed_at):
        chosen = table.victim(lambda key: (0,), needed_at=needed_at)
        return chosen.key if chosen is not None else None

    assert victim(None) == (2, 0)  # unclaimed first
    entries[(2, 0)].pins = 1
    assert victim(None) == (1, 0)  # claimed: the one needed last ((7, 1) after (5, 3) and (5, 0))
    assert victim((7, 0)) == (1, 0)
    assert victim((7, 1)) is None  # only what is needed after the fetch's own use may go
    entries[(1, 0)].pins = 1
    assert victim((5, 2)) == (3, 0)  # (5, 3): its first claim counts, not its later one
    assert victim((5, 3)) is None
    table.unclaim([(3, 0)], order=5)
    assert table.next_use((3, 0)) == (8, 3) and victim((7, 0)) == (3, 0)


def test_wanted_keys_come_soonest_needed_first_and_leave_when_resident_or_unclaimed():
    uses = {(2, 0): (1, 2), (0, 5): (3, 0), (1, 1): (1, 1), (3, 3): (2, 3)}
    resident: set = set()
    wanted = WantedKeys()
    for key, use in uses.items():
        wanted.add(key, 1, 0.0, use)
    wanted.add((0, 9), 2, 0.0, (0, 0))  # lower priority (background): after every route-ahead key

    def next_use(key):
        return uses.get(key, (0, 0) if key == (0, 9) else None)

    assert wanted.soonest(next_use, resident) == ((1, 1), (1, 1))
    wanted.take((1, 1))
    assert wanted.soonest(next_use, resident) == ((2, 0), (1, 2))
    uses[(2, 0)] = (4, 2)  # its first claim ended; a later one remains: it moves behind
    assert wanted.soonest(next_use, resident) == ((3, 3), (2, 3))
    resident.add((3, 3))  # a forward's own miss brought it in
    del uses[(0, 5)]  # its claims ended before a slot could be had
    assert wanted.soonest(next_use, resident) == ((2, 0), (4, 2))
    assert wanted.dropped == 1 and set(wanted.keys) == {(2, 0), (0, 9)}
    wanted.take((2, 0))
    assert wanted.soonest(next_use, resident) == ((0, 9), (0, 0))
    wanted.add((0, 9), 1, 5.0, (0, 0))  # asked again for a verify: it keeps when it was first asked
    assert wanted.keys[(0, 9)] == (1, 0.0) and wanted.soonest(next_use, resident) == ((0, 9), (0, 0))
    wanted.take((0, 9))
    assert wanted.soonest(next_use, resident) is None and not wanted.keys


def test_a_passed_layer_is_needed_after_every_claim_ahead_and_before_cold_experts_go():
    table = SlotTable(3, experts_per_layer=8)
    for key in [(0, 0), (0, 1), (1, 0)]:
        slot = table.take_free()
        assert slot is not None
        table.add(Entry(key=key, slot=slot, nbytes=1, requested_at=0.0, state=EntryState.READY))
    table.claim([(0, 0), (1, 0)], order=0)
    table.claim([(1, 0)], order=1)
    pass_claims(table.claims, [(0, 0)], order=0)  # claim 0's forward left layer 0
    assert table.next_use((0, 0)) == (PASSED, 0) and table.next_use((1, 0)) == (0, 1)

    def victim(needed_at):
        chosen = table.victim(lambda key: (0,), needed_at=needed_at)
        return chosen.key if chosen is not None else None

    assert victim((1, 1)) == (0, 1)  # the cold, unclaimed expert goes first
    table.entries[(0, 1)].pins = 1
    assert victim((1, 1)) == (0, 0)  # then the passed one: needed after every claim ahead
    assert victim((PASSED, 0)) is None
    table.unclaim([(0, 0)], order=PASSED)  # claim 0 released: its passed keys are unclaimed
    assert table.next_use((0, 0)) is None and (1, 0) in table.claims
