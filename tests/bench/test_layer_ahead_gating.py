"""benchmarks/layer_ahead_gating.py on the bundled target: its tables add up and read as a router's."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "layer_ahead_gating.py"


def test_the_guess_tables_on_the_bundled_target(monkeypatch, capsys):
    monkeypatch.setattr("pdflash.bench.workload.humaneval_prompts", lambda n: ["def add(a, b):", "class Stack:"][:n])
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--prompts", "2", "--max-tokens", "6"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    recall = float(re.search(r"recall of the top-4 guess: ([0-9.]+)", out).group(1))
    ranks = {int(r): float(v) for r, v in re.findall(r"^\| (\d) \| ([0-9.]+) \|$", out, re.M)}
    counts = [int(n) for n in re.findall(r"^\| \d\.\d-\d\.\d \| (\d+) \| [0-9.]+ \|$", out, re.M)]
    assert sorted(ranks) == list(range(8))
    # 2 prompts x 6 decoded tokens x 3 MoE layers after the first, 8 ranked guesses each
    assert sum(counts) == 2 * 6 * 3 * 8
    assert 0.0 < recall <= 1.0
    assert ranks[0] > ranks[7]  # the router's own order: its first guess is routed more often than its eighth
