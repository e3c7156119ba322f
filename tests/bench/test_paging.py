"""Offline demand paging (pdflash.bench.paging): hand-worked traces for each policy, pinning,
Belady's OPT never beaten on single-expert accesses, and the recorder's pass-through."""

import random

import pytest

from pdflash.bench.paging import REPLAYED, RecordingPolicy, replay
from pdflash.offload.eviction import LRU


def single(*experts: int) -> list[tuple[int, tuple[int, ...]]]:
    """One layer, one routed expert per forward."""
    return [(0, (e,)) for e in experts]


def test_lru_and_opt_on_a_hand_worked_trace():
    trace = single(0, 1, 2, 0, 1)  # 2 slots
    # LRU: 0, 1 miss; 2 evicts 0; 0 evicts 1; 1 evicts 2: every access misses
    assert replay(trace, 2, "lru", layers=1) == 5
    # OPT: 2 evicts 1 (next used at 4, after 0 at 3); 0 hits; 1 misses
    assert replay(trace, 2, "opt", layers=1) == 4


def test_next_launch_keeps_what_the_next_forward_routes():
    trace = single(0, 1, 2, 0)  # 2 slots; layers=1: the next forward is the next access
    # activation: when 2 arrives, 0 has the lowest decayed count (0.81 < 0.9) and goes; 0 misses again
    assert replay(trace, 2, "activation", layers=1) == 4
    # next-launch: 0 is routed by the next forward, so 1 goes instead and 0 hits
    assert replay(trace, 2, "next-launch", layers=1) == 3
    assert replay(trace, 2, "opt", layers=1) == 3


@pytest.mark.parametrize("policy", REPLAYED)
def test_a_forward_never_evicts_its_own_union(policy):
    # 3 experts routed at once on 2 slots: the third streams through; the next forward hits both kept
    trace = [(0, (0, 1, 2)), (0, (0, 1))]
    assert replay(trace, 2, policy, layers=1) == 3


def test_layers_are_separate_keys():
    trace = [(0, (5,)), (1, (5,)), (0, (5,)), (1, (5,))]  # expert 5 of two layers: 2 keys, 2 slots
    assert replay(trace, 2, "lru", layers=2) == 2


def test_opt_is_never_beaten_on_single_expert_accesses():
    rng = random.Random(0)
    for _ in range(50):
        trace = single(*(rng.randrange(6) for _ in range(40)))
        slots = rng.randrange(1, 6)
        opt = replay(trace, slots, "opt", layers=1)
        for policy in ("lru", "activation", "next-launch"):
            assert opt <= replay(trace, slots, policy, layers=1), (policy, slots, trace)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy 'mru' is not one of"):
        replay(single(0), 1, "mru", layers=1)


def test_recording_policy_passes_everything_through_and_writes_requests_down():
    trace: list = []
    recorded, plain = RecordingPolicy(LRU(), trace), LRU()
    for layer, union in [(0, [3, 1]), (1, [2]), (0, [1])]:
        recorded.observe(layer, iter(union))  # any iterable, read once
        plain.observe(layer, union)
    assert trace == [(0, (3, 1)), (1, (2,)), (0, (1,))]
    assert recorded.name == "lru"
    for key in [(0, 3), (0, 1), (1, 2), (1, 9)]:
        assert recorded.score(key) == plain.score(key)
    recorded.forget((0, 1))
    assert recorded.score((0, 1)) == (0,)
