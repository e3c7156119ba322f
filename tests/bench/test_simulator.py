"""The simulator: the closed form of one sequence without cache hits, determinism under a seed,
the Zipf routing model, the real scheduler's 2-D admission, and the `simulate --json` contract."""

import json
import math

import attrs
import pytest

from pdflash import cli
from pdflash.bench.configs import CONFIGS, parse_configs
from pdflash.bench.profiles import get_profile
from pdflash.bench.routing import Round, ZipfRouting
from pdflash.bench.sim_clients import simulate_closed_loop
from pdflash.bench.simulator import SimSetup

LAYERS, EXPERTS, EXPERT_BYTES = 3, 64, 1_000_000


@attrs.frozen
class ConstantCosts:
    """A cost model double: fixed seconds per phase, to check the simulator's own arithmetic."""

    prefill: float = 0.010
    draft: float = 0.004
    verify_dense: float = 0.002
    verify_experts: float = 0.004
    step: float = 0.001
    description: str = "constant"

    def prefill_s(self, tokens, seqs, experts, *, offloaded):
        return self.prefill, 0.0

    def draft_s(self, seqs, tokens, context, *, speculative, router):
        return self.draft

    def verify_s(self, tokens, seqs, experts, *, offloaded):
        return self.verify_dense, self.verify_experts

    def mixed_s(self, tokens, seqs, prompt_tokens, prompts, experts, *, offloaded):
        return self.verify_dense + self.prefill, self.verify_experts

    def step_s(self, seqs):
        return self.step


@attrs.frozen
class FreshExperts:
    """A routing double: round k routes expert k at every layer (never seen before: no hits),
    nothing is projected (no prefetch), and every round commits `tau` tokens (`tau - 1` for the
    routing sequences in `slow_routes`)."""

    tau: int
    slow_routes: frozenset[int] = frozenset()
    description: str = "fresh experts"

    def prefill_union(self, seq, prompt_tokens):
        return frozenset()

    def round(self, seq, index, tokens, start):
        return Round(
            tokens=tokens,
            acceptance_length=min(tokens, self.tau - (seq in self.slow_routes)),
            actual=frozenset((layer, index) for layer in range(LAYERS)),
            projected=frozenset(),
        )


def _setup(config, costs, routing, **overrides):
    byte_map = {(layer, e): EXPERT_BYTES for layer in range(LAYERS) for e in range(EXPERTS)}
    values = dict(
        config=CONFIGS[config],
        costs=costs,
        routing=routing,
        byte_map=byte_map,
        moe_layers=tuple(range(LAYERS)),
        top_k=1,
        block_size=8,
        cache_slots=LAYERS * EXPERTS,
        cache_bytes=LAYERS * EXPERTS * EXPERT_BYTES,
        link_bytes_per_s=1e9,
        max_num_seqs=4,
    )
    return SimSetup(**values | overrides)


@pytest.mark.parametrize("config, tau", [("ar", 1), ("dflash-token", 3)])
def test_one_sequence_without_cache_hits_equals_the_arithmetic(config, tau):
    costs, max_tokens = ConstantCosts(), 40
    result = simulate_closed_loop(
        _setup(config, costs, FreshExperts(tau)), [16], concurrency=1, requests_per_client=1, max_tokens=max_tokens
    )
    rounds = math.ceil((max_tokens - 1) / tau)  # the prefill emits the first token
    fetch_s = EXPERT_BYTES / 1e9  # one expert per layer per round, fetched on demand, serially
    # each layer runs its attention, then asks for its expert, waits for it and computes it
    verify_s = costs.verify_dense + LAYERS * fetch_s + costs.verify_experts
    # every round drafts, or plain rounds project their anchor: only the first, after the prefill,
    # on a lane; the verify before each later one projected its anchor already (plain_round)
    lane_calls = rounds if tau > 1 else 1
    wall_s = rounds * costs.step + costs.prefill + lane_calls * costs.draft + rounds * verify_s
    assert result.wall_s == pytest.approx(wall_s)
    assert result.ms_per_token == pytest.approx(1e3 * wall_s / max_tokens)
    assert result.tokens == max_tokens
    assert result.bytes_per_token == pytest.approx(rounds * LAYERS * EXPERT_BYTES / max_tokens)
    assert result.hit_rate == 0.0
    assert result.exposed_fetch_share == pytest.approx(rounds * LAYERS * fetch_s / wall_s)
    assert result.link_busy_share == pytest.approx(rounds * LAYERS * fetch_s / wall_s)  # every copy waited on
    assert result.tau == pytest.approx((max_tokens - 1) / rounds)  # the last round is clipped


@attrs.frozen
class ProjectedFreshExperts(FreshExperts):
    """FreshExperts whose projection names every expert its round routes (all prefetched at launch)."""

    def round(self, seq, index, tokens, start):
        r = super().round(seq, index, tokens, start)
        return attrs.evolve(r, projected=r.actual)


def test_a_launchs_bookkeeping_runs_before_its_prefetch_starts():
    """The engine streams, plans and registers a round on its event loop before the tick that
    prefetches it, so a launch's bookkeeping adds its whole seconds to a round whose copies are
    all prefetched: none of it hides behind the link (it did while the simulator charged it
    on the lane after the prefetch had started)."""
    max_tokens = 20

    def wall_s(step):
        setup = _setup("ar", ConstantCosts(step=step), ProjectedFreshExperts(1))
        return simulate_closed_loop(setup, [16], concurrency=1, requests_per_client=1, max_tokens=max_tokens).wall_s

    rounds = max_tokens - 1  # the prefill emits the first token
    assert wall_s(0.001) - wall_s(0.0) == pytest.approx(rounds * 0.001)


def _zipf_point(seed, config="dflash-2d", concurrency=4):
    p = get_profile("qwen3-30b-a3b@h200-pcie5")
    routing = ZipfRouting(
        layers=LAYERS, experts=EXPERTS, top_k=4, exponent=0.8, locality=0.3, acceptance=[1, 2, 3, 5, 8], seed=seed
    )
    from pdflash.bench.costs import RooflineCosts

    budgets = {
        "verify_token_budget": 32,
        "verify_token_cap": 32,
        "verify_byte_budget": 40 * EXPERT_BYTES,
        "verify_byte_cap": LAYERS * 32 * EXPERT_BYTES,
    }
    setup = _setup(config, RooflineCosts(p), routing, cache_slots=80, budgets=budgets)
    return simulate_closed_loop(setup, [64] * 8, concurrency=concurrency, requests_per_client=2, max_tokens=24)


def test_the_simulation_is_deterministic_under_a_seed():
    first, again, other = _zipf_point(seed=3), _zipf_point(seed=3), _zipf_point(seed=4)
    assert first.as_dict() == again.as_dict()
    assert (first.bytes_per_token, first.wall_s) != (other.bytes_per_token, other.wall_s)


def test_a_byte_budget_smaller_than_a_batch_splits_verifies_across_ticks():
    token_only, two_d = _zipf_point(seed=0, config="dflash-token"), _zipf_point(seed=0, config="dflash-2d")
    # 40 experts' bytes per tick cannot hold four blocks' marginal union: 2-D splits batches that
    # token-only verifies whole, so it launches more verifies, fewer of them full
    token_batches, two_d_batches = token_only.extra["verify_batches"], two_d.extra["verify_batches"]
    assert sum(two_d_batches.values()) > sum(token_batches.values())
    assert two_d_batches.get(4, 0) < token_batches[4]
    assert two_d.tokens == token_only.tokens


def test_zipf_routing_draws_top_k_distinct_experts_skewed_by_popularity():
    routing = ZipfRouting(layers=2, experts=32, top_k=4, exponent=1.2, locality=0.0, acceptance=[1], seed=0)
    ids = routing._draw(seq=0, n=4000)  # [n, L, k]
    assert all(len(set(token_layer)) == 4 for token_layer in ids.reshape(-1, 4).tolist())
    counts = sorted((ids[:, 0, :] == e).sum() for e in range(32))
    assert counts[-1] > 5 * counts[0]  # the most popular expert of a layer beats the least by far
    flat = ZipfRouting(layers=1, experts=32, top_k=4, exponent=0.0, locality=0.0, acceptance=[1], seed=0)
    flat_counts = sorted((flat._draw(seq=0, n=4000) == e).sum() for e in range(32))
    assert flat_counts[-1] < 1.3 * flat_counts[0]  # s = 0 is uniform


def test_zipf_routing_replays_the_recorded_acceptance_in_order_per_sequence():
    """Acceptance is a property of the sequence: each replays the recording from its own offset."""
    recorded = [1, 2, 3, 4, 5, 6, 7, 8]
    routing = ZipfRouting(layers=1, experts=32, top_k=4, exponent=0.8, locality=0.0, acceptance=recorded, seed=0)
    runs = {seq: [routing.round(seq, i, 8, 0).acceptance_length for i in range(10)] for seq in range(6)}
    for lengths in runs.values():
        at = recorded.index(lengths[0])
        assert lengths == [recorded[(at + i) % len(recorded)] for i in range(10)]
    assert len({lengths[0] for lengths in runs.values()}) > 1  # sequences start at different offsets
    clipped = routing.round(0, 10, 2, 0)  # a short block commits at most its tokens
    assert clipped.acceptance_length <= 2


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match=r"'b9' is not a configuration; valid: ar \(B0\)"):
        parse_configs("ar,b9")
    assert [c.name for c in parse_configs("b0,dflash-2d")] == ["ar", "dflash-2d"]


def test_configs_take_a_projector():
    chosen = parse_configs("b2@route-head,dflash-2d@router,ar")
    assert [(c.name, c.label, c.projector) for c in chosen] == [
        ("dflash-2d@route-head", "B2@route-head", "route-head"),
        ("dflash-2d@router", "B2@router", "router"),
        ("ar", "B0", None),
    ]
    assert chosen[0].two_dimensional and chosen[0].scheduling == CONFIGS["dflash-2d"].scheduling
    with pytest.raises(ValueError, match=r"'ar@psychic' names projector 'psychic'; valid: last-union, router"):
        parse_configs("ar@psychic")


def test_simulate_json_contract(capsys):
    argv = "simulate --profile qwen3-30b-a3b@h200-pcie5 --configs ar --concurrency 1"
    code = cli.main(
        [*argv.split(), "--expert-cache-bytes", str(24 * 10**9), "--json", "--max-tokens", "8", "--min-requests", "1"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    first = report["results"][0]
    assert (first["config"], first["concurrency"]) == ("ar", 1)
    assert first["ms_per_token"] > get_profile("qwen3-30b-a3b@h200-pcie5").ar_step_s * 1e3
    assert report["regime_ratio"] == pytest.approx(get_profile("qwen3-30b-a3b@h200-pcie5").regime_ratio)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--concurrency", "0"], "--concurrency=0 is invalid: it must be >= 1"),
        (["--expert-cache-bytes", "1000"], "--expert-cache-bytes=1000 holds 0 experts of 9,437,184 bytes"),
        (["--configs", "b7"], "'b7' is not a configuration"),
    ],
)
def test_bad_simulate_flags_exit_2_naming_the_value(capsys, argv, named):
    assert cli.main(["simulate", "--configs", "ar", "--concurrency", "1", *argv]) == 2
    assert named in capsys.readouterr().err


def test_a_prompt_waits_for_the_sequence_about_to_leave_and_is_prefilled_with_its_successor(monkeypatch):
    # a prefill (0.2 s) costs the same whatever its prompts (a link-bound one fetches every
    # expert); a round about 13 ms. Client 0 (routes 0, 1) commits 3 tokens a round, client 1
    # (routes 2, 3) 2, so client 0's first request ends ~6 rounds (0.08 s) before client 1's:
    # its successor waits for client 1's, and the two are prefilled as one
    def point():
        setup = _setup(
            "dflash-token", ConstantCosts(prefill=0.2), FreshExperts(3, frozenset({2, 3})), prefill_mode="alone"
        )
        return simulate_closed_loop(setup, [16] * 4, concurrency=2, requests_per_client=2, max_tokens=40)

    held = point()
    monkeypatch.setattr("pdflash.bench.simulator.prefill_waits", lambda **_: False)
    alone = point()
    assert held.tokens == alone.tokens == 4 * 40
    assert (held.extra["prefill_batches"], alone.extra["prefill_batches"]) == (2, 3)
    # the held prompt's seat idled less than the lone prefill stalled every seat
    assert held.wall_s < alone.wall_s
    assert held.ttft_p99_ms > alone.ttft_p99_ms


@pytest.mark.parametrize(("prefill_mode", "batches", "ridden"), [("auto", 1, 2), ("verify", 1, 2), ("alone", 3, 0)])
def test_behind_a_link_a_successor_prefills_inside_the_next_verify_of_the_sequences_in_rounds(
    monkeypatch, prefill_mode, batches, ridden
):
    # the seating rule aside, each client's second request arrives while the other client's
    # sequence is in its rounds: it rides that sequence's next verify, unless prefills run alone
    monkeypatch.setattr("pdflash.bench.simulator.prefill_waits", lambda **_: False)
    routing = FreshExperts(3, frozenset({2, 3}))
    setup = _setup("dflash-token", ConstantCosts(prefill=0.2), routing, prefill_mode=prefill_mode)
    result = simulate_closed_loop(setup, [16] * 4, concurrency=2, requests_per_client=2, max_tokens=40)
    assert result.tokens == 4 * 40
    assert (result.extra["prefill_batches"], result.extra["prefills_in_verifies"]) == (batches, ridden)


def test_zipf_routing_routes_each_committed_token_once():
    """A round read twice (its verified prefix and its whole block's shadow drafts) routes its
    committed tokens and accepts the same; its rejected drafts are other tokens; the next block
    starts at the first position not committed and routes the tokens committed there; a prompt
    sent again replays its routes (as greedy decoding of it would)."""
    routing = ZipfRouting(layers=2, experts=32, top_k=4, exponent=0.8, locality=0.3, acceptance=[3, 5], seed=0)
    prompt = routing.prefill_union(0, 16)
    whole = routing.round(0, 0, 8, 0)
    committed = whole.acceptance_length  # 3 or 5: the anchor and its accepted drafts
    assert committed in (3, 5) and len(whole.positions) == 8
    verified = routing.round(0, 0, 2, 0)
    assert verified.positions == whole.positions[:2] and verified.actual == frozenset().union(*whole.positions[:2])
    assert verified.acceptance_length == 2
    again = routing.round(0, 0, 8, 0)
    assert again.positions[:committed] == whole.positions[:committed]
    assert again.positions[committed:] != whole.positions[committed:]  # rejected drafts: drawn afresh
    after = routing.round(0, 1, 8, committed)  # the next block covers the positions after them
    assert after.acceptance_length != committed  # the next recorded round
    assert (
        routing.round(0, 1, 8, committed).positions[: after.acceptance_length]
        == after.positions[: after.acceptance_length]
    )
    assert routing.prefill_union(0, 16) == prompt
    with pytest.raises(ValueError, match="prefilled with 16 prompt tokens, now 8"):
        routing.prefill_union(0, 8)
