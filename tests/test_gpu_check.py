"""tools/gpu_check.sh on the CPU (the CUDA stages skip or shrink): it runs every stage, installs
this tree, and writes a summary that says what ran; the summary's verdicts from stage records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["env", "install", "cuda-tests", "bench-kernels", "bench-cli", "bench-engine", "bench-offload"]


def run_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    environment = os.environ | {
        "OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",  # the CPU smoke run, even on a machine with a GPU
        "OMP_NUM_THREADS": "1",
        **env,
    }
    environment.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, out


def test_the_gpu_check_runs_every_stage_on_the_cpu_and_summarizes_them(tmp_path):
    done, out = run_check(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and not summary["ran_on_gpu"]
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == STAGES
    assert {name: s["status"] for name, s in stages.items()} == {name: "pass" for name in STAGES} | {
        "bench-cli": "skipped",
        "bench-engine": "skipped",
    }
    assert "no CUDA" in stages["bench-cli"]["note"]
    for name in STAGES:
        if stages[name]["status"] == "pass":
            assert (out / f"{name}.log").is_file()
    # the install is this tree's, into the work folder, not onto the interpreter
    site = tmp_path / "work" / "site"
    assert (site / "pdflash" / "kernels" / "triton_swiglu.py").is_file() and list(site.glob("pdflash-*.dist-info"))
    assert "pdflash 0.1.0 from" in (out / "install.log").read_text()  # the install's own import check
    # every CUDA test was collected and skipped for want of a GPU
    tests = summary["cuda_tests"]
    assert tests["total"] >= 40 and tests["skipped"] == tests["total"]
    assert all("CUDA" in t["message"] for t in tests["tests"])
    assert summary["env"]["gpu"] is None and summary["env"]["torch"]
    bench = summary["benchmarks"]
    assert bench["bench-kernels"]["rows"][0]["rel_err"] < 1e-4
    assert "became pdflash bench" in stages["bench-engine"]["note"]  # its sweeps are pdflash bench's now
    assert len(bench["bench-offload"]["rows"]) == 4
    markdown = (out / "summary.md").read_text()
    assert "**OK**" in markdown and "| cuda-tests | pass |" in markdown and "No CUDA device" in markdown


def test_a_rerun_runs_only_the_stages_it_names(tmp_path):
    done, out = run_check(tmp_path, GPU_CHECK_ONLY="bench-kernels")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    statuses = {s["stage"]: s["status"] for s in summary["stages"]}
    assert statuses == {name: "skipped" for name in STAGES} | {
        "env": "pass",
        "install": "pass",
        "bench-kernels": "pass",
    }
    assert all(s["note"] == "not in GPU_CHECK_ONLY" for s in summary["stages"] if s["status"] == "skipped")


def test_stages_the_total_leaves_no_time_for_fail_the_check(tmp_path):
    done, out = run_check(tmp_path, GPU_CHECK_TOTAL_S="10")  # less than the summary's reserve
    assert done.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["ok"]
    assert {s["stage"]: s["status"] for s in summary["stages"]}["env"] == "no-time"


def summarize(tmp_path: Path, stages: list[dict], env: dict, junit: str | None = None) -> tuple[int, dict]:
    (tmp_path / "stages.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    (tmp_path / "env.json").write_text(json.dumps(env))
    if junit is not None:
        (tmp_path / "cuda-tests.xml").write_text(junit)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_summary.py"), str(tmp_path)], capture_output=True, timeout=60
    )
    return done.returncode, json.loads((tmp_path / "summary.json").read_text())


def stage(name: str, status: str) -> dict:
    return dict(stage=name, status=status, rc=0 if status == "pass" else 124, seconds=1, note="", log=f"{name}.log")


JUNIT = """<testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.cuda.test_cuda_spec" name="test_a" time="1.5"/>
<testcase classname="tests.cuda.test_cuda_spec" name="test_b" time="0.1"><skipped message="why"/></testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize(
    ("status", "cuda", "ok"),
    [("pass", True, False), ("pass", False, True), ("timeout", False, False), ("fail", False, False)],
)
def test_summary_fails_on_a_bad_stage_and_on_cuda_tests_skipped_on_a_gpu(tmp_path, status, cuda, ok):
    rc, summary = summarize(
        tmp_path, [stage("env", "pass"), stage("cuda-tests", status)], {"cuda_available": cuda}, JUNIT
    )
    assert (rc == 0) == ok and summary["ok"] == ok
    assert summary["cuda_tests"]["passed"] == 1 and summary["cuda_tests"]["skipped"] == 1
    if cuda:  # on a GPU a skipped CUDA test means the check did not answer
        assert summary["stages"][1]["status"] == "incomplete"
