"""`pdflash serve --replicas 1` as a command: SIGTERM ends its streams with their final message,
the command exits 0, and every Ray process it started has stopped. Needs the `ray` extra."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.ray


def _descendants(pid):
    """Every process below `pid` (Ray's GCS, raylet and workers are children of the driver that started them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_streams_cleanly_and_stops_every_ray_process_it_started(tiny_target):
    cmd = [sys.executable, "-m", "pdflash.cli", "serve", "--target", str(tiny_target), "--port", "0"]
    cmd += ["--replicas", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = ""
        while not line.startswith("pdflash: serving"):
            line = proc.stderr.readline()
            assert line, "pdflash serve exited before announcing its URL"
        url = line.split(" on ", 1)[1].split()[0]
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ray_processes = _descendants(proc.pid)
        assert ray_processes, "the local Ray instance runs below pdflash serve"
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1800, "stream": True}
        ) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert rc == 0 and "Traceback" not in err, err
    final = json.loads((rest[-2] if len(rest) > 1 else first)[5:])
    assert rest[-1] == "data: [DONE]" and final["choices"][0]["finish_reason"] == "abort", rest[-3:]
    deadline = time.monotonic() + 10
    while [p for p in ray_processes if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in ray_processes if _alive(p)], "every Ray process the command started has stopped"
