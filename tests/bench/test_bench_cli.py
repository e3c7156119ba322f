"""`pdflash bench` flags: --cache-share resizes the device cache on the profile's link, and a bad
share exits 2 naming the flag."""

import json

import pytest

from pdflash import cli
from pdflash.bench.commands import DEFAULT_PROFILE
from pdflash.bench.profiles import get_profile


def test_cache_share_sets_the_cache_and_keeps_the_profile_s_link(pair, monkeypatch, capsys):
    monkeypatch.setattr("pdflash.bench.runner.humaneval_prompts", lambda n: ["def f(x):", "class A:"][:n])
    target, drafter = pair
    argv = [
        "bench", "--target", str(target), "--drafter", str(drafter), "--configs", "ar", "--concurrency", "1",
        "--max-tokens", "2", "--min-requests", "1", "--poisson-requests", "0", "--prompts", "2", "--json",
    ]  # fmt: skip
    assert cli.main([*argv, "--cache-share", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["time_scale"]["cache_fraction"] == 0.5
    assert report["time_scale"]["regime_ratio"] == pytest.approx(get_profile(DEFAULT_PROFILE).regime_ratio)
    assert [r["config"] for r in report["results"]] == ["ar"]


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2"])
def test_a_cache_share_outside_0_1_exits_2_naming_it(capsys, share):
    assert cli.main(["bench", "--configs", "ar", "--concurrency", "1", "--cache-share", share]) == 2
    assert f"--cache-share={float(share)} is invalid" in capsys.readouterr().err
