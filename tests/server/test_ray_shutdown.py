"""`pdflash serve --replicas 1` as a command: SIGTERM (or Ctrl+C, SIGINT to its process group) ends
its streams with their final message, the command exits 0, and every Ray process it started has
stopped. Needs the `ray` extra."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from websockets.sync.client import connect

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


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(lambda proc: proc.send_signal(signal.SIGTERM), id="SIGTERM"),
        pytest.param(lambda proc: os.killpg(proc.pid, signal.SIGINT), id="Ctrl+C"),  # the whole process group
    ],
)
def test_a_signal_ends_streams_cleanly_and_stops_every_ray_process_it_started(tiny_target, stop):
    cmd = [sys.executable, "-m", "pdflash.cli", "serve", "--target", str(tiny_target), "--port", "0"]
    cmd += ["--replicas", "1", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
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
        with connect(url.replace("http", "ws") + "/ws") as socket:
            socket.send(json.dumps({"type": "start", "id": 0, "prompt": [3, 4], "params": {"max_tokens": 1800}}))
            with httpx.stream(
                "POST", url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1800, "stream": True}
            ) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                stop(proc)
                rest = [line for line in lines if line.startswith("data:")]
            while (message := json.loads(socket.recv(timeout=30)))["type"] in ("delta", "stats"):
                pass
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert rc == 0 and "Traceback" not in err, err
    final = json.loads((rest[-2] if len(rest) > 1 else first)[5:])
    assert rest[-1] == "data: [DONE]" and final["choices"][0]["finish_reason"] == "abort", rest[-3:]
    assert message["type"] == "done" and message["finish_reason"] == "abort", message
    deadline = time.monotonic() + 10
    while [p for p in ray_processes if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in ray_processes if _alive(p)], "every Ray process the command started has stopped"


def test_replicas_asking_for_more_cpus_than_the_machine_has_are_refused_by_name(tiny_target):
    cpus = os.cpu_count()
    cmd = [sys.executable, "-m", "pdflash.cli", "serve", "--target", str(tiny_target), "--port", "0"]
    cmd += ["--replicas", "2", "--cpus-per-replica", str(cpus)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 2, result.stderr
    expected = f"2 replicas x {cpus} CPUs (--cpus-per-replica) need {2 * cpus} CPUs; the Ray cluster has {cpus}"
    assert expected in result.stderr
