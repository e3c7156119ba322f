"""Paired ratios: each repeat's tokens/s over the same repeat's best baseline, hand-worked."""

import json

import pytest

from pdflash import cli
from pdflash.bench.metrics import PointResult
from pdflash.bench.ratios import paired_ratios, ratio_table


def _point(config: str, concurrency: int, runs: list[float]) -> PointResult:
    """A sweep point reduced to what the ratios read: its repeats' tokens/s (the median kept as the point's)."""
    return PointResult(
        config=config,
        concurrency=concurrency,
        requests=1,
        tokens=1,
        wall_s=1.0,
        tokens_per_s=sorted(runs)[(len(runs) - 1) // 2],
        ms_per_token=1.0,
        ttft_p50_ms=1.0,
        ttft_p99_ms=1.0,
        itl_p50_ms=1.0,
        itl_p99_ms=1.0,
        tau=1.0,
        bytes_per_token=0.0,
        hit_rate=1.0,
        projection_coverage_bytes=None,
        exposed_fetch_share=0.0,
        admission_wait_p50_ms=0.0,
        admission_wait_p99_ms=0.0,
        fairness=1.0,
        engine_overhead=0.0,
        extra={"tokens_per_s_runs": runs},
    )


def test_each_repeat_is_divided_by_the_best_baseline_of_that_repeat():
    points = [
        _point("ar", 1, [10.0, 10.0, 10.0]),
        _point("dflash-token", 1, [8.0, 13.0, 9.0]),
        _point("adaptive", 1, [10.0, 12.0, 9.0]),
    ]
    (ratio,) = paired_ratios(points)  # no dflash-2d, adaptive-token or resident: one comparison
    assert ratio.name == "adaptive / max(B0, B1, B2)" and ratio.concurrency == 1
    assert ratio.ratios == pytest.approx((1.0, 12.0 / 13.0, 0.9))  # best baselines 10, 13, 10
    assert ratio.median == pytest.approx(12.0 / 13.0)
    # the ratio of the medians (10 / 10 = 1.00) would hide that adaptive lost two repeats of three
    assert "| adaptive / max(B0, B1, B2) | 0.92 [0.90–1.00] |" in ratio_table([ratio])


def test_resident_adaptive_is_compared_with_fixed_blocks_and_with_the_better_of_those_and_plain():
    points = [
        _point("resident-ar", 16, [12.0, 9.0]),
        _point("resident", 16, [10.0, 10.0]),
        _point("resident-adaptive", 16, [9.0, 11.0]),
    ]
    ratios = {r.name: r.ratios for r in paired_ratios(points)}
    assert ratios == {
        "resident-adaptive / resident (B=8)": pytest.approx((0.9, 1.1)),
        "resident-adaptive / max(B3p, B3) (plain, B=8)": pytest.approx((0.75, 1.1)),  # best: 12 plain, then 10
    }


def test_comparisons_need_their_numerator_a_baseline_and_as_many_repeats():
    points = [
        _point("adaptive", 4, [5.0, 6.0]),
        _point("adaptive-token", 4, [4.0, 6.0]),
        _point("ar", 4, [5.0]),  # a report with fewer repeats for it: no pairing against it
        _point("dflash-2d", 16, [3.0]),  # no dflash-token beside it
    ]
    ratios = paired_ratios(points)
    assert [(r.name, r.concurrency, r.ratios) for r in ratios] == [
        ("adaptive / adaptive-token (2-D / token-only)", 4, (1.25, 1.0))
    ]
    assert ratio_table([]) == ""


def test_bench_reports_the_paired_ratios_of_its_repeats(pair, monkeypatch, capsys):
    monkeypatch.setattr("pdflash.bench.runner.humaneval_prompts", lambda n: ["def f(x):", "class A:"][:n])
    target, drafter = pair
    argv = [
        "bench", "--target", str(target), "--drafter", str(drafter), "--configs", "ar,adaptive", "--concurrency", "1",
        "--max-tokens", "3", "--min-requests", "1", "--poisson-requests", "0", "--prompts", "2", "--repeats", "2",
        "--json",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    runs = {r["config"]: r["extra"]["tokens_per_s_runs"] for r in report["results"]}
    (ratio,) = report["paired_ratios"]
    assert ratio["name"] == "adaptive / max(B0, B1, B2)" and ratio["concurrency"] == 1
    assert ratio["ratios"] == pytest.approx([a / b for a, b in zip(runs["adaptive"], runs["ar"], strict=True)])
    assert len(ratio["ratios"]) == 2
