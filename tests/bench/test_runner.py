"""`pdflash bench` over the public engine API: a point's figures come from the engine and the
offload provider, and the routing recorder's trace matches what the requests emitted."""

import pytest

from pdflash.bench.configs import CONFIGS
from pdflash.bench.profiles import TimeScale, get_profile
from pdflash.bench.routing import TraceRouting, write_traces
from pdflash.bench.runner import BenchPlan, engine_recipe, run_point, token_routed_bytes
from pdflash.sampling import SamplingParams


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
    pipe_s = offloaded.bytes_per_token * offloaded.tokens / (scale.link_gbps * 1e9)  # what the emulated pipe carried
    assert 0.9 * pipe_s / offloaded.wall_s <= offloaded.link_busy_share <= 1.0
    assert resident.bytes_per_token == 0 and resident.link_busy_share == 0
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
    write_traces(tmp_path / "routing.json.gz", {"speculative": sequences}, {"target": str(target)})
    gzipped = TraceRouting.load(tmp_path / "routing.json.gz", "speculative")  # written compressed, read back
    assert gzipped.sequences == TraceRouting.load(path, "speculative").sequences
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


def test_recorded_probabilities_replay_and_a_block_unions_its_positions(tmp_path):
    """A scored projection replays with its probabilities; an adaptive block's are its positions'
    1 − Π (1 − p), as the route head unions a block; a trace without them replays as certain."""
    steps = [
        {"tokens": 1, "acceptance_length": 1, "actual": [[0, 1]], "projected": [[0, 1]], "projected_probability": p}
        for p in ([[0, 1, 0.5], [0, 2, 0.1]], [[0, 1, 0.5]], [[1, 3, 0.9]])
    ]
    spec = [{"tokens": 4, "acceptance_length": 2, "actual": [[0, 1]], "projected": [[0, 1]]}]
    traces = {
        kind: [{"prompt_ids": [1], "prompt_tokens": 1, "prefill_union": [[0, 1]], "rounds": rounds}]
        for kind, rounds in (("speculative", spec), ("autoregressive", steps))
    }
    path = tmp_path / "routing.json"
    write_traces(path, traces, {})
    assert TraceRouting.load(path, "autoregressive").round(0, 0, 1, 0).projected_probability == {
        (0, 1): 0.5,
        (0, 2): 0.1,
    }
    assert TraceRouting.load(path, "speculative").round(0, 0, 4, 0).projection.probability is None
    block = TraceRouting.load(path, "adaptive").round(seq=0, index=0, tokens=3, start=0).projected_probability
    assert block == pytest.approx({(0, 1): 0.75, (0, 2): 0.1, (1, 3): 0.9})


def test_the_recorder_keeps_a_scored_projection_s_probabilities(pair):
    from pdflash.bench.routing import RoutingRecorder
    from pdflash.spec.drafter import load_drafter
    from pdflash.spec.projection import Projection
    from pdflash.spec.projection.passes import LastUnionProjector
    from pdflash.spec.speculator import Speculator
    from pdflash.target.loader import load_target

    class Scored(LastUnionProjector):  # the last union at 0.8 each, and one expert outside it at 0.25
        def project(self, speculator, sessions, blocks):
            scored = []
            for p in super().project(speculator, sessions, blocks):
                outside = next((0, e) for e in range(64) if (0, e) not in p.union)
                scored.append(Projection(p.union, dict.fromkeys(p.union, 0.8) | {outside: 0.25}))
            return scored

    target, drafter = pair
    loaded = load_target(target)
    spec = Speculator(
        loaded.model, load_drafter(drafter, loaded.model), expert_nbytes=loaded.expert_nbytes, projector=Scored()
    )
    recorder = RoutingRecorder(spec)
    sessions = spec.begin_sessions([([5, 9, 11], SamplingParams(max_tokens=4))])
    spec.draft_rounds(sessions)
    spec.verify_rounds(sessions)
    (recorded,) = recorder.sequences()[0]["rounds"]
    chances = {(layer, e): p for layer, e, p in recorded["projected_probability"]}
    projected = {tuple(key) for key in recorded["projected"]}
    assert {key for key, p in chances.items() if p == 0.8} == projected
    assert [p for key, p in chances.items() if key not in projected] == [0.25]
