"""The simulated pipeline and adaptive speculation against closed forms.

Two sequences whose verifies alternate overlap one's copies with the other's compute, so wall
= max(Σ compute, Σ link) plus the one fetch (or compute) nothing can hide; one sequence alone
is dependent (its next round's copies wait for its verify), so wall = Σ (link + compute). The
adaptive configurations ask the engine's own planner and policy: a link-bound sequence falls
back to (or never leaves) plain decoding and fetches exactly what autoregressive decoding
does; a resident one that accepts everything keeps B.
"""

import attrs
import pytest
from test_simulator import ConstantCosts

from pdflash.bench import simulator
from pdflash.bench.configs import CONFIGS
from pdflash.bench.routing import Round
from pdflash.bench.sim_clients import simulate_closed_loop, simulate_open_loop
from pdflash.bench.sim_confidence import SimConfidence
from pdflash.bench.simulator import SimSetup

EXPERT_BYTES, BLOCK = 1_000_000, 8


def Costs(**seconds: float) -> ConstantCosts:
    """The simulator tests' constant cost double with every phase free unless given."""
    return ConstantCosts(
        **(dict.fromkeys(("prefill", "draft", "verify_dense", "verify_experts", "step"), 0.0) | seconds)
    )


@attrs.frozen
class PositionRouting:
    """A routing double on one MoE layer: the token at position p routes expert p of its sequence's
    own range (never shared, never seen before); a block's drafts after the first `tau - 1` are
    rejected and route experts no other block routes. Projection is exact."""

    tau: int  # tokens a full block commits
    description: str = "positions"

    def prefill_union(self, seq, prompt_tokens):
        return frozenset()

    def round(self, seq, index, tokens, start):
        accepted = min(tokens, self.tau)
        base = seq * 10_000
        positions = tuple(
            frozenset({(0, base + start + j)}) if j < accepted else frozenset({(0, base + 5_000 + BLOCK * start + j)})
            for j in range(tokens)
        )
        union = frozenset().union(*positions)
        return Round(tokens=tokens, acceptance_length=accepted, actual=union, projected=union, positions=positions)


@attrs.frozen
class RoundRouting:
    """A routing double on one MoE layer: every token of sequence s's round k routes expert (s, k)
    (one new expert per verify, never shared); projection is exact; each round commits one token."""

    description: str = "one expert per round"

    def prefill_union(self, seq, prompt_tokens):
        return frozenset()

    def round(self, seq, index, tokens, start):
        union = frozenset({(0, seq * 10_000 + index)})
        return Round(tokens=tokens, acceptance_length=1, actual=union, projected=union, positions=(union,) * tokens)


def _setup(config, costs, routing, *, link_bytes_per_s=1e9, budgets=None, cache_bytes=None):
    experts = 20_000
    byte_map = {(0, e): EXPERT_BYTES for e in range(experts)}
    return SimSetup(
        config=CONFIGS[config],
        costs=costs,
        routing=routing,
        byte_map=byte_map,
        moe_layers=(0,),
        top_k=1,
        block_size=BLOCK,
        cache_slots=experts,  # nothing is ever evicted
        cache_bytes=experts * EXPERT_BYTES if cache_bytes is None else cache_bytes,
        link_bytes_per_s=link_bytes_per_s,
        max_num_seqs=4,
        budgets=budgets,
    )


# one verify charges one new expert: a byte budget of one expert per tick admits one sequence per tick
ONE_PER_TICK = {
    "verify_token_budget": 2 * BLOCK,
    "verify_token_cap": 2 * BLOCK,
    "verify_byte_budget": EXPERT_BYTES,
    "verify_byte_cap": BLOCK * EXPERT_BYTES,
}


def _one_per_tick(link_s: float, compute_s: float) -> SimSetup:
    """Fixed DFlash, one sequence per verify, one expert of `link_s` copy and `compute_s` compute."""
    return _setup(
        "dflash-2d",
        Costs(verify_experts=compute_s),
        RoundRouting(),
        link_bytes_per_s=EXPERT_BYTES / link_s,
        budgets=ONE_PER_TICK,
    )


@pytest.mark.parametrize("link_s, compute_s", [(0.004, 0.010), (0.010, 0.004), (0.006, 0.006)])
def test_alternating_verifies_hide_the_link_behind_compute(link_s, compute_s):
    rounds, tokens = 6, 7  # tau = 1: one token per round after the prefill's
    setup = _one_per_tick(link_s, compute_s)
    result = simulate_closed_loop(setup, [4, 4], concurrency=2, requests_per_client=1, max_tokens=tokens)
    assert result.tokens == 2 * tokens and result.tau == 1.0
    total_link, total_compute = 2 * rounds * link_s, 2 * rounds * compute_s
    assert result.wall_s == pytest.approx(max(total_link, total_compute) + min(link_s, compute_s))
    assert result.extra["verify_batches"] == {1: 2 * rounds}  # every verify held one sequence


@pytest.mark.parametrize("link_s, compute_s", [(0.004, 0.010), (0.010, 0.004)])
def test_one_sequence_waits_for_its_own_copies(link_s, compute_s):
    rounds = 6
    setup = _one_per_tick(link_s, compute_s)
    result = simulate_closed_loop(setup, [4], concurrency=1, requests_per_client=1, max_tokens=rounds + 1)
    assert result.wall_s == pytest.approx(rounds * (link_s + compute_s))


def test_derived_budgets_bound_no_bytes():
    # with a cache budget of one verify's union, both sequences' rounds still go as one batch
    link_s, compute_s, rounds = 0.004, 0.010, 6
    costs = Costs(verify_experts=compute_s)
    setup = _setup(
        "dflash-derived", costs, RoundRouting(), link_bytes_per_s=EXPERT_BYTES / link_s, cache_bytes=EXPERT_BYTES
    )
    result = simulate_closed_loop(setup, [4, 4], concurrency=2, requests_per_client=1, max_tokens=rounds + 1)
    assert result.extra["verify_batches"] == {2: rounds}
    # each round copies both experts (2 x link) and computes them in waves as they land: the
    # last expert's half of the compute after the last copy
    assert result.wall_s == pytest.approx(rounds * max(compute_s, 2 * link_s + compute_s / 2))


@pytest.mark.parametrize(
    "config, draft_s, merged", [("dflash-derived", 0.002, True), ("resident", 0.002, True), ("resident", 0.020, False)]
)
def test_with_a_link_a_launch_gathers_the_sequences_still_drafting(config, draft_s, merged):
    # B arrives while A verifies, so B's prefill and first draft trail A's. With a link, A's next
    # launch waits while the link still copies B's union and B drafts, and the two merge into
    # one batch. Resident (B3), it waits only while B's draft is due sooner than a verify's
    # fixed cost (the launch merging saves): a 2 ms draft merges; a 20 ms one, longer than
    # the whole verify, leaves the two alternating for good
    costs = Costs(prefill=0.003, draft=draft_s, verify_dense=0.001, verify_experts=0.004)
    setup = _setup(config, costs, RoundRouting(), link_bytes_per_s=EXPERT_BYTES / 0.020)
    result = simulate_open_loop(setup, [4, 4], arrival_times_s=[0.0, 0.001], max_tokens=8)
    assert (max(result.extra["verify_batches"]) == 2) is merged


LINK_BOUND = Costs(draft=0.001, verify_dense=0.001, verify_experts=0.002)  # ms of compute; 1 s per expert


def test_a_link_bound_sequence_falls_back_to_plain_decoding():
    tau, tokens = 3, 24
    routing = PositionRouting(tau=tau)

    def point(config):
        setup = _setup(config, LINK_BOUND, routing, link_bytes_per_s=EXPERT_BYTES / 1.0)
        return simulate_closed_loop(setup, [4], concurrency=1, requests_per_client=1, max_tokens=tokens)

    ar, adaptive, fixed = point("ar"), point("adaptive"), point("dflash-token")
    # with a link the planner decodes plainly until a verify is measured, and then the policy
    # finds no block worth its bytes: every round is plain decoding, fetching what AR does
    assert adaptive.extra["block_decisions"] == {1: tokens - 1}
    assert adaptive.bytes_per_token == ar.bytes_per_token
    assert fixed.extra["block_decisions"] == {BLOCK: -(-(tokens - 1) // tau)}
    assert fixed.bytes_per_token > 2 * adaptive.bytes_per_token  # its rejected drafts' experts


def test_a_resident_sequence_that_accepts_every_draft_keeps_the_full_block(monkeypatch):
    # a drafter sure of every draft the target accepts (and of none it rejects): no cut stops a block
    sure = SimConfidence([0] * 11 + [1], [1] + [0] * 11)
    monkeypatch.setattr(simulator.SimConfidence, "bundled", classmethod(lambda cls: sure))
    routing = PositionRouting(tau=BLOCK)
    costs = Costs(draft=0.004, verify_dense=0.002, verify_experts=0.004)
    setup = _setup("resident-adaptive", costs, routing)
    result = simulate_closed_loop(setup, [4], concurrency=1, requests_per_client=1, max_tokens=1 + 6 * BLOCK)
    assert result.extra["block_decisions"] == {BLOCK: 6}
    assert result.tau == BLOCK
    assert result.bytes_per_token == 0


@pytest.mark.parametrize("draft_s, link_s", [(0.004, 0.010), (0.010, 0.004)])
def test_the_next_anchor_is_fetched_while_its_sequence_drafts(draft_s, link_s):
    """One sequence whose every round routes one new expert, the one its anchor routes: after the
    first round (its anchor came from the prefill, nothing claimed it), each verify's end claims
    the next round's expert, so its copy runs beside the draft instead of after it."""
    rounds, compute_s = 6, 0.003
    setup = _setup(
        "dflash-token",
        Costs(draft=draft_s, verify_experts=compute_s),
        RoundRouting(),
        link_bytes_per_s=EXPERT_BYTES / link_s,
    )
    result = simulate_closed_loop(setup, [4], concurrency=1, requests_per_client=1, max_tokens=rounds + 1)
    first = draft_s + link_s + compute_s
    assert result.wall_s == pytest.approx(first + (rounds - 1) * (max(draft_s, link_s) + compute_s))
    assert result.bytes_per_token * result.tokens == pytest.approx(rounds * EXPERT_BYTES)  # each expert once
