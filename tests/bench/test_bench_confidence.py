"""benchmarks/bench_confidence.py on the bundled pair: its counts add up, and its AUC is the rank statistic."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_confidence.py"


@pytest.fixture(autouse=True)
def _threads_restored():
    """The script sets torch's thread count; the tests after it keep theirs."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_auc_counts_pairs_an_accepted_draft_was_surer_in_ties_half():
    auc = runpy.run_path(str(SCRIPT))["auc"]
    assert auc([0.9, 0.8], [0.1, 0.85]) == 0.75  # 3 of the 4 pairs
    assert auc([0.5, 0.5], [0.5]) == 0.5 and auc([1.0], [0.0]) == 1.0 and auc([0.0], [1.0]) == 0.0
    assert auc([0.5], []) != auc([0.5], [])  # nan: nothing to compare


@pytest.mark.parametrize("temperature", ["0", "0.7"], ids=["greedy", "sampled"])
def test_the_confidence_tables_on_the_bundled_pair(monkeypatch, capsys, temperature):
    monkeypatch.setattr("pdflash.bench.workload.humaneval_prompts", lambda n: ["def add(a, b):", "class Stack:"][:n])
    argv = [
        str(SCRIPT),
        "--prompts",
        "2",
        "--max-tokens",
        "12",
        "--threads",
        "1",
        "--temperature",
        temperature,
    ]  # no plot: matplotlib is the bench extra's
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    read = int(re.search(r"; (\d+) drafts read", out).group(1))
    by_bucket = [int(n) for n in re.findall(r"^confidence \[[0-9. ,]+\): +(\d+) drafts", out, re.M)]
    by_position = [int(n) for n in re.findall(r"^position \d: +(\d+) drafts", out, re.M)]
    assert read > 0 and sum(by_bucket) == sum(by_position) == read
    assert 0.0 <= float(re.search(r"AUC of confidence for acceptance: ([0-9.]+|nan)", out).group(1)) <= 1.0
