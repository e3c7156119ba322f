"""`pdflash bench` over the public engine API: a point's figures come from the engine and the
offload provider, and the routing recorder's trace matches what the requests emitted."""

import pytest

from pdflash.bench.configs import CONFIGS
from pdflash.bench.profiles import TimeScale, get_profile
from pdflash.bench.routing import TraceRouting, write_traces
from pdflash.bench.runner import BenchPlan, engine_recipe, run_point, token_routed_bytes
from pdflash.sampling import SamplingParams
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-pair")
    target = write_tiny_target(root / "target", seed=0)
    return target, write_tiny_drafter(root / "drafter", target, block_size=4)


def test_a_time_scaled_point_reports_engine_and_provider_figures(pair):
    target, drafter = pair
    plan = BenchPlan(
        target=target,
        drafter=drafter,
        configs=tuple(CONFIGS.values()),
        concurrency=(2,),
        max_tokens=6,
        min_requests=2,
        repeats=1,
    )
    scale = TimeScale.for_profile(
        get_profile("qwen3-30b-a3b@h200-pcie5"), ar_step_s=0.002, token_routed_bytes=token_routed_bytes(target)
    )
    recipe = engine_recipe(plan, scale)
    pool = [[5 + i, 9, 11 + i, 40] for i in range(4)]
    recorded = {}
    points = {}
    for name in ("dflash-token", "resident"):
        cfg = CONFIGS[name]
        hook = None
        if name == "dflash-token":

            def hook(engine):
                from pdflash.bench.routing import RoutingRecorder

                recorded["speculative"] = RoutingRecorder(engine.speculator)

        points[name] = run_point(
            recipe.build(plan, cfg),
            cfg,
            pool,
            SamplingParams(max_tokens=6),
            concurrency=2,
            requests_per_client=1,
            recorder=hook,
        )
    offloaded, resident = points["dflash-token"], points["resident"]
    assert offloaded.requests == resident.requests == 2
    assert offloaded.tokens == sum(
        1 + sum(s["rounds"][i]["acceptance_length"] for i in range(len(s["rounds"])))
        for s in recorded["speculative"].sequences()
    )
    assert offloaded.bytes_per_token > 0 and 0.0 <= offloaded.hit_rate <= 1.0
    assert offloaded.exposed_fetch_share > 0  # the emulated link binds
    assert resident.bytes_per_token == 0
    assert 0 < offloaded.fairness <= 1.0


def test_a_recorded_trace_replays_its_rounds(pair, tmp_path):
    target, drafter = pair
    sequences = [
        {
            "prompt_ids": [1, 2],
            "prompt_tokens": 2,
            "prefill_union": [[0, 1], [1, 2]],
            "rounds": [{"tokens": 4, "acceptance_length": 3, "actual": [[0, 5]], "projected": [[0, 5], [1, 1]]}],
        }
    ]
    path = tmp_path / "routing.json"
    write_traces(path, {"speculative": sequences}, {"target": str(target)})
    trace = TraceRouting.load(path, "speculative")
    assert trace.prefill_union(0, 2) == {(0, 1), (1, 2)}
    r = trace.round(seq=1, index=0, tokens=2, start=0)  # sequence 1 wraps to recorded sequence 0; clipped block
    assert (r.acceptance_length, r.actual, r.projected) == (2, {(0, 5)}, {(0, 5), (1, 1)})
    assert trace.output_tokens(0) == 4
    with pytest.raises(ValueError, match="no 'autoregressive' trace recorded"):
        TraceRouting.load(path, "autoregressive")
    with pytest.raises(ValueError, match="'adaptive' needs it"):
        TraceRouting.load(path, "adaptive")


def test_an_adaptive_replay_routes_the_autoregressive_steps_its_block_covers(tmp_path):
    steps = [{"tokens": 1, "acceptance_length": 1, "actual": [[0, 10 + i]], "projected": [[1, i]]} for i in range(4)]
    spec = [{"tokens": 4, "acceptance_length": 3, "actual": [[0, 5]], "projected": [[0, 5]]}]
    traces = {
        kind: [{"prompt_ids": [1, 2], "prompt_tokens": 2, "prefill_union": [[0, 1]], "rounds": rounds}]
        for kind, rounds in (("speculative", spec), ("autoregressive", steps))
    }
    path = tmp_path / "routing.json"
    write_traces(path, traces, {})
    r = TraceRouting.load(path, "adaptive").round(seq=0, index=0, tokens=2, start=1)
    assert r.acceptance_length == 2  # min(block, the recorded round's acceptance length)
    assert r.positions == ({(0, 11)}, {(0, 12)})  # steps 1 and 2 verified the tokens at those positions
    assert (r.actual, r.projected) == ({(0, 11), (0, 12)}, {(1, 1), (1, 2)})
    traces["autoregressive"][0]["prompt_ids"] = [3]
    write_traces(path, traces, {})
    with pytest.raises(ValueError, match="ran different prompts"):
        TraceRouting.load(path, "adaptive")
