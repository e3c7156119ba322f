"""`pdflash simulate --replicas N`: clients split evenly over independent engines, figures combined."""

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.bench.metrics import PointResult
from pdflash.bench.replicated import replica_loads, replicated_point
from pdflash.cli import main


@given(st.integers(1, 512), st.integers(1, 16))
def test_replica_loads_split_every_client_as_evenly_as_integers_allow(concurrency, replicas):
    loads = replica_loads(concurrency, replicas)
    assert sum(loads) == concurrency and len(loads) == min(concurrency, replicas)
    assert max(loads) - min(loads) <= 1 and min(loads) >= 1


def test_replica_loads_refuse_zero_replicas():
    with pytest.raises(ValueError, match="--replicas=0 is invalid"):
        replica_loads(4, 0)


def _point(load: int) -> PointResult:
    """A stand-in engine whose figures are simple functions of its load (isolates the combining)."""
    return PointResult(
        config="B2",
        concurrency=load,
        requests=2 * load,
        tokens=100 * load,
        wall_s=1.0 + load,
        tokens_per_s=10.0 * load,
        ms_per_token=float(load),
        ttft_p50_ms=5.0 * load,
        ttft_p99_ms=9.0 * load,
        itl_p50_ms=2.0 * load,
        itl_p99_ms=3.0 * load,
        tau=1.0 + load,
        bytes_per_token=1000.0,
        hit_rate=0.5,
        projection_coverage_bytes=None,
        exposed_fetch_share=0.1 * load,
        admission_wait_p50_ms=float(load),
        admission_wait_p99_ms=2.0 * load,
        fairness=1.0 / load,
        engine_overhead=0.2,
    )


def test_uneven_loads_sum_throughput_and_keep_the_worst_latency():
    point = replicated_point(5, 2, _point)  # loads 3 and 2
    assert point.concurrency == 5 and point.requests == 10 and point.tokens == 500
    assert point.tokens_per_s == 30.0 + 20.0
    assert point.ttft_p99_ms == 27.0 and point.fairness == pytest.approx(1 / 3)
    assert point.tau == pytest.approx((4.0 * 300 + 3.0 * 200) / 500)  # token-weighted
    assert point.extra["replica_loads"] == [3, 2]


def _simulate(capsys, *flags):
    common = ["--configs", "B2", "--max-tokens", "16", "--min-requests", "2", "--json", "-"]
    assert main(["simulate", *flags, *common]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]


def test_simulate_two_replicas_at_c_is_twice_one_engine_at_c_over_two(capsys):
    one = _simulate(capsys, "--concurrency", "2")
    two = _simulate(capsys, "--concurrency", "4", "--replicas", "2")
    assert two["concurrency"] == 4 and two["extra"]["replica_loads"] == [2, 2]
    assert two["tokens_per_s"] == pytest.approx(2 * one["tokens_per_s"])
    assert two["tokens"] == 2 * one["tokens"] and two["ttft_p99_ms"] == one["ttft_p99_ms"]
    fields = set(attrs.fields_dict(PointResult)) - {"concurrency", "requests", "tokens", "tokens_per_s", "extra"}
    assert {f: two[f] for f in fields} == pytest.approx({f: one[f] for f in fields}, nan_ok=True)
