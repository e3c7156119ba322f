"""A routing trace regrouped (pdflash.bench.regrouping): the rounds each kind stands for, closed-loop
clients, cohort schedules and the accesses of a batched round, on a hand-written trace."""

import pytest

from pdflash.bench.regrouping import ReplayRound, batch_accesses, clients, layered, recorded_rounds, schedule
from pdflash.bench.routing import write_traces

# one sequence, two MoE layers; the autoregressive run routed expert p at layer 0 and 10 + p at layer 1
# for its token p (four tokens); the speculative run accepted 2 tokens a round, twice
AR_ROUNDS = [
    {"tokens": 1, "acceptance_length": 1, "actual": [[0, p], [1, 10 + p]], "projected": [[0, p]]} for p in range(4)
]
SPEC_ROUNDS = [
    {"tokens": 8, "acceptance_length": 2, "actual": [[0, 20], [1, 21]], "projected": [[0, 20]]},
    {"tokens": 8, "acceptance_length": 2, "actual": [[0, 22], [1, 23]], "projected": [[0, 22]]},
]
PREFILL = [[0, 30], [1, 31]]


@pytest.fixture
def trace(tmp_path):
    sequence = {"prompt_ids": [1, 2, 3], "prompt_tokens": 3, "prefill_union": PREFILL}
    path = tmp_path / "routing.json"
    write_traces(
        path,
        {"autoregressive": [{**sequence, "rounds": AR_ROUNDS}], "speculative": [{**sequence, "rounds": SPEC_ROUNDS}]},
        {"target": "hand-written"},
    )
    return path


def test_recorded_kinds_are_the_recorded_rounds(trace):
    [ar] = recorded_rounds(trace, "autoregressive", layers=2)
    assert [r.committed_tokens for r in ar] == [1, 1, 1, 1]
    assert ar[2].routed == [{2}, {12}]
    assert ar[0].prefill == [{30}, {31}] and all(r.prefill is None for r in ar[1:])
    [spec] = recorded_rounds(trace, "speculative", layers=2)
    assert [(r.routed, r.committed_tokens) for r in spec] == [([{20}, {21}], 2), ([{22}, {23}], 2)]


def test_the_oracle_verifies_exactly_what_each_round_commits(trace):
    [oracle] = recorded_rounds(trace, "oracle", layers=2)
    # two rounds of 2, routing the autoregressive run's tokens 0-1, then 2-3
    assert [(r.routed, r.committed_tokens) for r in oracle] == [
        ([{0, 1}, {10, 11}], 2),
        ([{2, 3}, {12, 13}], 2),
    ]
    assert oracle[0].prefill == [{30}, {31}]


def test_a_fixed_block_routes_its_rejected_positions_too(trace):
    [block] = recorded_rounds(trace, "block-4", layers=2)
    # round 0 covers tokens 0-3 and commits 2; round 1 from token 2 covers 2-3 (the run's last token
    # stands in past its end) and commits 2: the run is covered
    assert [(r.routed, r.committed_tokens) for r in block] == [
        ([{0, 1, 2, 3}, {10, 11, 12, 13}], 2),
        ([{2, 3}, {12, 13}], 2),
    ]
    [plain] = recorded_rounds(trace, "block-1", layers=2)
    assert [r.committed_tokens for r in plain] == [1, 1, 1, 1]


def test_an_unknown_kind_is_refused(trace):
    with pytest.raises(ValueError, match="trace kind 'block-x'"):
        recorded_rounds(trace, "block-x", layers=2)


def test_clients_run_their_share_of_the_sequences_one_after_another():
    a, b, c = (ReplayRound([{e}], 1) for e in range(3))
    assert clients([[a], [b], [c]], 2) == [[a, c], [b]]


def test_schedule_together_and_in_cohorts():
    assert schedule([2, 1, 2], cohort=3, quantum=1) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (2, 1)]]
    # cohorts {0, 1} and {2}, one round a turn
    assert schedule([2, 1, 2], cohort=2, quantum=1) == [[(0, 0), (1, 0)], [(2, 0)], [(0, 1)], [(2, 1)]]
    # each cohort runs to its end before the next one's turn
    assert schedule([2, 1, 2], cohort=2, quantum=10**9) == [[(0, 0), (1, 0)], [(0, 1)], [(2, 0)], [(2, 1)]]


def test_a_batch_that_starts_sequences_prefills_them_first():
    first = ReplayRound(layered([[0, 1], [1, 2]], 2), 1, prefill=layered([[0, 7], [1, 8]], 2))
    later = ReplayRound(layered([[0, 3], [1, 2]], 2), 2)
    assert batch_accesses([first, later], layers=2) == [(0, (7,)), (1, (8,)), (0, (1, 3)), (1, (2,))]
    assert batch_accesses([later], layers=2) == [(0, (3,)), (1, (2,))]
