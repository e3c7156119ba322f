"""The summary of a tools/gpu_check.sh run: summary.json and summary.md in its output folder.

Reads what the stages left there: stages.jsonl (one line per stage: status, rc, seconds, note),
env.json, the CUDA tests' junit XML and the benchmarks' JSON files. Exits 1 when a stage failed
or timed out, or when CUDA was present and some CUDA test did not run (skipped is not passed).
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BAD = ("fail", "timeout", "incomplete", "no-time")  # no-time: the total ran out before the stage


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def cuda_tests(xml: Path) -> dict | None:
    """Counts and per-test outcomes from pytest's junit XML (None if the stage wrote none)."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tests.append(dict(name=name, outcome=outcome, seconds=float(case.get("time") or 0), message=message))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return dict(total=len(tests), **counts, tests=tests)


def summarize(out: Path) -> dict:
    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines() if line.strip()]
    env = read_json(out / "env.json") or {}
    tests = cuda_tests(out / "cuda-tests.xml")
    cuda = bool(env.get("cuda_available"))
    for stage in stages:
        if stage["stage"] == "cuda-tests" and tests is not None:
            stage["note"] += f" ({tests['passed']} passed, {tests['failed'] + tests['error']} failed, "
            stage["note"] += f"{tests['skipped']} skipped of {tests['total']})"
            if cuda and stage["status"] == "pass" and (tests["skipped"] or not tests["total"]):
                stage["status"] = "incomplete"  # on a GPU every CUDA test must run
    benchmarks = {
        name: data
        for name in ("bench", "bench-engine", "bench-offload", "bench-kernels")
        if (data := read_json(out / f"{name}.json")) is not None
    }
    return dict(
        ok=not any(s["status"] in BAD for s in stages),
        ran_on_gpu=cuda,
        env=env,
        stages=stages,
        cuda_tests=tests,
        benchmarks=benchmarks,
    )


def fmt(value, spec: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "—"
    return format(value, spec)


def markdown(summary: dict) -> str:
    env = summary["env"]
    smi = env.get("nvidia_smi") or {}
    lines = ["# pdflash GPU check", ""]
    if summary["ran_on_gpu"]:
        lines.append(
            f"{env.get('gpu')} (driver {smi.get('driver_version', '?')}, {env.get('gpu_memory_gib')} GiB, "
            f"compute {env.get('compute_capability')}); torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
            f"triton {env.get('triton')}, Python {env.get('python')}; {env.get('cpu_cores')} CPU cores, "
            f"{env.get('memory_gib')} GiB. Host-to-device copies: {env.get('h2d_pinned_gbps')} GB/s pinned, "
            f"{env.get('h2d_pageable_gbps')} GB/s pageable."
        )
    elif not env:
        lines.append("No environment facts: the env stage did not run (see its note below).")
    else:
        lines.append(
            f"No CUDA device: a CPU smoke run (torch {env.get('torch', '?')}, Python {env.get('python', '?')}, "
            f"{env.get('cpu_cores', '?')} CPU cores); CUDA stages skipped or run with tiny budgets."
        )
    lines += [
        "",
        f"**{'OK' if summary['ok'] else 'FAILED'}**",
        "",
        "| stage | status | s | note |",
        "|---|---|---:|---|",
    ]
    for s in summary["stages"]:
        lines.append(f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['note'].replace('|', '/')} |")
    tests = summary["cuda_tests"]
    if tests:
        bad = [t for t in tests["tests"] if t["outcome"] in ("failed", "error")]
        lines += ["", f"CUDA tests: {tests['passed']} passed, {len(bad)} failed, {tests['skipped']} skipped."]
        lines += [f"- {t['outcome']}: `{t['name']}`: {t['message']}" for t in bad]
    bench = summary["benchmarks"]
    if kernels := bench.get("bench-kernels"):
        lines += ["", f"Grouped SwiGLU ({kernels['grouped']} vs the per-expert torch loop), {kernels['shapes']}, "]
        lines[-1] += f"{kernels['machine']['device']}, median of {kernels['repeats']}:"
        lines += [
            "",
            "| T | routed | torch loop ms | grouped ms | speedup | rel err |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in kernels["rows"]:
            speedup = r["torch_loop_ms"] / r["grouped_ms"]
            lines.append(
                f"| {r['tokens']} | {r['routed']} | {r['torch_loop_ms']:.3f} | {r['grouped_ms']:.3f} | "
                f"{speedup:.2f}x | {r['rel_err']:.1e} |"
            )
    if engine := bench.get("bench-engine"):
        models, machine = engine["models"], engine["machine"]
        lines += ["", f"Engine: {Path(models['target']).name} + {Path(models['drafter']).name}, greedy, "]
        lines[-1] += (
            f"{models['max_tokens']} tokens a request ({machine['accelerator']}; offloaded: {machine['link']}):"
        )
        lines += ["", "| run | concurrency | tokens/s | τ | ITL p50 ms | ITL p99 ms | fetched bytes/token |"]
        lines += ["|---|---:|---:|---:|---:|---:|---:|"]
        for group in ("resident", "offloaded"):
            for run, points in (engine.get(group) or {}).items():
                for c, p in points.items():
                    lines.append(
                        f"| {group}: {run} | {c} | {p['tokens_per_s']:.1f} | {p['tau']:.2f} | "
                        f"{fmt(p['itl_p50_ms'], '.2f')} | {fmt(p['itl_p99_ms'], '.2f')} | {p['fetched_per_token']:,.0f} |"
                    )
    if offload := bench.get("bench-offload"):
        lines += ["", f"Offloaded decoding, one session at a time ({offload['device']}, link {offload['link']}):"]
        lines += ["", "| mode | route-ahead | τ | link bytes/token | exposed fetch ms/token | hit rate | tok/s |"]
        lines += ["|---|---|---:|---:|---:|---:|---:|"]
        for r in offload["rows"]:
            lines.append(
                f"| {r['mode']} | {'yes' if r['route_ahead'] else 'no'} | {r['tau']:.2f} | {r['bytes_per_token']:,.0f} | "
                f"{r['exposed_ms_per_token']:.3f} | {r['hit_rate']:.3f} | {r['tokens_per_second']:.1f} |"
            )
    if "bench" in bench:
        lines += ["", "`pdflash bench --quick` wrote bench.json (see it for its tables)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    out = Path(sys.argv[1])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
