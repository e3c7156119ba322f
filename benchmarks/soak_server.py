"""Soak of `pdflash serve`: mixed HTTP (SSE and whole) and websocket load with random cancels
and a few hostile requests, for a bounded time; counts lost streams, server errors and RSS.

    python benchmarks/soak_server.py [--minutes 10] [--clients 24] [--target DIR] [--drafter DIR]

Every started request ends as final, lost or abandoned (started = final + lost + abandoned).
A started request is *lost* unless its client got exactly one final message: SSE a chunk
with a finish_reason and then `[DONE]`, a whole response its body, a websocket generation
exactly one `done` or `error` (also after a `cancel`). Requests the client abandons by
closing the connection expect nothing and are counted apart. A *server error* is any 5xx
other than 503 overloaded, a websocket `internal_error` / `generation_failed`, or a
traceback in the server's log. RSS is the server process's, sampled every 5 s; "flat" is
the last sample against the one at the end of the warm-up (the first 10% of the run).
Without --target the run uses a tiny random checkpoint (make-tiny), so the engine is fast
and the server's own paths dominate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import websockets

HOSTILE = [
    (b'{"prompt": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "application/json"),
    (b'{"prompt": "a", "seed": 18446744073709551616, "temperature": 1}', "application/json"),
    (b'{"prompt": "a", "max_tokens": 2}', "text/plain"),
    (b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}', "application/json"),
    (b'{"prompt": "a", "temperature": NaN}', "application/json"),
]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, key: str) -> None:
        self.counts[key] += 1


async def sse(client: httpx.AsyncClient, tally: Tally, rng: random.Random, chat: bool) -> None:
    body: dict = {"max_tokens": rng.randint(4, 48), "stream": True, "temperature": rng.choice([0, 0.8])}
    if chat:
        body["messages"] = [{"role": "user", "content": "write a loop"}]
    else:
        body["prompt"] = rng.choice(["def f(x):", "import os\n", "class A:"])
    cancel_after = rng.randint(1, 6) if rng.random() < 0.3 else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            tally.add("server_error" if r.status_code >= 500 and r.status_code != 503 else f"http_{r.status_code}")
            return
        tally.add("started")
        events, finishes = 0, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if cancel_after is not None and events >= cancel_after:
                tally.add("abandoned")  # closing the connection: no final message expected
                return
            data = line[6:]
            if data == "[DONE]":
                tally.add("final" if finishes == 1 else "lost")
                if finishes != 1:
                    tally.add("lost_sse")
                return
            chunk = json.loads(data)
            if "error" in chunk:
                tally.add("server_error")
            elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is not None:
                finishes += 1
        tally.add("lost")


async def whole(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    body = {"prompt": "def g():", "max_tokens": rng.randint(2, 24), "n": rng.choice([1, 1, 2])}
    try:
        r = await client.post("/v1/completions", json=body, timeout=rng.choice([60, 60, 0.05]))
    except httpx.TimeoutException:
        tally.add("started")
        tally.add("abandoned")  # the client gave up waiting: nothing more is expected
        return
    if r.status_code == 200:
        tally.add("started")
        complete = all(c["finish_reason"] for c in r.json()["choices"])
        tally.add("final" if complete else "lost")
        if not complete:
            tally.add("lost_whole")
    else:
        tally.add("server_error" if r.status_code >= 500 and r.status_code != 503 else f"http_{r.status_code}")


async def hostile(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    content, media = rng.choice(HOSTILE)
    r = await client.post("/v1/completions", content=content, headers={"content-type": media})
    tally.add("server_error" if r.status_code >= 500 else f"hostile_{r.status_code}")


async def ws_session(url: str, tally: Tally, rng: random.Random) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        pending: dict[int, int] = {}  # id -> final messages seen
        for i in range(rng.randint(1, 4)):
            params = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8])}
            await ws.send(json.dumps({"type": "start", "id": i, "prompt": "def h(y):", "params": params}))
            pending[i] = 0
            tally.add("started")
        if rng.random() < 0.2:
            await ws.send("{not json")
        to_cancel = {i for i in pending if rng.random() < 0.3}
        abandon = rng.random() < 0.1
        deadline = time.monotonic() + 60
        while any(v == 0 for v in pending.values()) and time.monotonic() < deadline:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            kind, gen_id = message["type"], message.get("id")
            if kind == "delta" and gen_id in to_cancel:
                to_cancel.discard(gen_id)
                await ws.send(json.dumps({"type": "cancel", "id": gen_id}))
            if kind == "error" and message["code"] == "unknown_id":
                continue  # the answer to a cancel that crossed its generation's done: not a final message
            if kind in ("done", "error") and gen_id in pending:
                pending[gen_id] += 1
                if kind == "error" and message["code"] in ("internal_error", "generation_failed"):
                    tally.add("server_error")
            elif kind == "error" and message.get("code") == "internal_error":
                tally.add("server_error")
            if kind == "delta" and abandon:  # closing the socket: its running generations expect nothing
                for count in pending.values():
                    tally.add("abandoned" if count == 0 else "final" if count == 1 else "lost")
                    if count > 1:
                        tally.add("lost_ws")
                return
        for count in pending.values():
            tally.add("final" if count == 1 else "lost")
            if count != 1:
                tally.add("lost_ws")


async def worker(base: str, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(["sse", "chat", "whole", "ws", "hostile"], [30, 10, 20, 35, 5])[0]
            try:
                if kind in ("sse", "chat"):
                    await sse(client, tally, rng, chat=kind == "chat")
                elif kind == "whole":
                    await whole(client, tally, rng)
                elif kind == "ws":
                    await ws_session(base.replace("http", "ws") + "/ws", tally, rng)
                else:
                    await hostile(client, tally, rng)
            except (httpx.TransportError, websockets.ConnectionClosed, TimeoutError) as exc:
                tally.add(f"client_error_{type(exc).__name__}")


async def soak(base: str, pid: int, seconds: float, clients: int) -> dict:
    tally, samples = Tally(), []
    deadline = time.monotonic() + seconds
    started = time.monotonic()

    async def sample() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - started, rss_mb(pid)))
            await asyncio.sleep(5)

    await asyncio.gather(sample(), *(worker(base, deadline, tally, seed) for seed in range(clients)))
    warm = next((mb for t, mb in samples if t >= seconds * 0.1), samples[0][1])
    return {"tally": dict(tally.counts), "rss_mb": samples, "rss_after_warmup_mb": warm, "rss_last_mb": samples[-1][1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdflash-soak-")
    if args.target is None:
        subprocess.run(
            [sys.executable, "-m", "pdflash.cli", "make-tiny", f"{tmp}/tiny"], check=True, capture_output=True
        )
        args.target = Path(f"{tmp}/tiny")
    cmd = [sys.executable, "-m", "pdflash.cli", "serve", "--target", str(args.target), "--port", "0"]
    cmd += ["--max-num-seqs", "32", "--log-level", "warning"] + (
        ["--drafter", str(args.drafter)] if args.drafter else []
    )
    log_path = Path(tmp) / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w+") as log:
        server = subprocess.Popen(cmd, stderr=log, env=env)
        try:
            while "pdflash: serving" not in log_path.read_text():
                if server.poll() is not None:
                    raise SystemExit(f"pdflash serve exited: {log_path.read_text()[-2000:]}")
                time.sleep(0.2)
            line = next(ln for ln in log_path.read_text().splitlines() if ln.startswith("pdflash: serving"))
            base = line.split(" on ", 1)[1].split()[0]
            while True:
                try:
                    if httpx.get(base + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            result = asyncio.run(soak(base, server.pid, args.minutes * 60, args.clients))
            metrics = httpx.get(base + "/metrics").text
        finally:
            server.terminate()
            rc = server.wait(timeout=30)
    text = log_path.read_text()
    tally = result["tally"]
    lost, errors = tally.get("lost", 0), tally.get("server_error", 0) + text.count("Traceback")
    result |= {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "minutes": args.minutes,
        "clients": args.clients,
        "target": str(args.target),
        "exit_code": rc,
        "tracebacks": text.count("Traceback"),
        "lost": lost,
        "server_errors": errors,
        "ws_generations": [ln for ln in metrics.splitlines() if ln.startswith("pdflash_ws_generations_total")],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mb"}, indent=1))
    print(
        f"soak {args.minutes:g} min, {args.clients} clients: {tally.get('started', 0)} started, "
        f"{tally.get('final', 0)} final, {lost} lost, {tally.get('abandoned', 0)} abandoned, {errors} server errors; "
        f"RSS {result['rss_after_warmup_mb']:.0f} MB after warm-up -> {result['rss_last_mb']:.0f} MB; exit {rc}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if lost == 0 and errors == 0 and rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
