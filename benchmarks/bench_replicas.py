"""Aggregate tokens/s of `pdflash serve` with one engine, one Ray Serve replica and two, side by side.

    python benchmarks/bench_replicas.py [--concurrency 16] [--requests 48] [--max-tokens 64] [--cpus 2]

Every setup serves the bundled pair (DFlash) from at most `--cpus` cores: one engine in this
process (no Ray, one torch thread), one replica of one CPU, one replica reserving all
`--cpus`, and two replicas splitting them. Each runs the same closed loop over HTTP:
`--concurrency` clients streaming (SSE) `--requests` greedy completions of `--max-tokens`
tokens, after a warm-up; tokens/s is all streamed tokens over the wall time. Prints one table
with each setup's ratio to the one-replica, one-CPU run, and the machine (with its load: the
cores may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time

import httpx
import torch

from pdflash.bundled import default_drafter, default_target
from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app

PROMPTS = ["def fib(n):", "def is_prime(n):", "class Stack:", "def merge(a, b):", "import os\n\ndef walk(path):"]
SETTINGS = ServerSettings(model_name="bench")


async def closed_loop(url: str, concurrency: int, requests: int, max_tokens: int) -> tuple[int, float]:
    """(streamed tokens, wall seconds) of `requests` streams from `concurrency` clients."""
    todo = list(range(requests))
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            i = todo.pop()
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "stream": True}
            body["stream_options"] = {"include_usage": True}
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                        tokens += usage["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return tokens, time.perf_counter() - started


def measure(url: str, args: argparse.Namespace) -> float:
    asyncio.run(closed_loop(url, 2, 4, 8))  # warm-up
    tokens, wall_s = asyncio.run(closed_loop(url, args.concurrency, args.requests, args.max_tokens))
    return tokens / wall_s


def wait_ready(url: str, replicas: int) -> None:
    deadline = time.monotonic() + 300
    while True:
        health = httpx.get(url + "/health", timeout=30)
        if health.status_code == 200 and health.json().get("ready_replicas", 1) >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replicas were not ready after 300 s: {health.text}")
        time.sleep(0.5)


def one_engine(options: dict, args: argparse.Namespace) -> float:
    torch.set_num_threads(1)
    engine = AsyncEngine.from_pretrained(options["target"], options["drafter"], max_num_seqs=args.concurrency)
    with BackgroundServer(create_app(engine, SETTINGS)) as server:
        return measure(server.url, args)


def on_replicas(options: dict, args: argparse.Namespace, replicas: int, cpus: float) -> float:
    from pdflash.server.ray_front import ReplicaFront
    from pdflash.server.ray_launch import ReplicaOptions, ray_replicas
    from pdflash.server.replica import ReplicaSpec

    layout = ReplicaOptions(replicas=replicas, cpus_per_replica=cpus)
    spec = ReplicaSpec(engine_options=options | {"max_num_seqs": args.concurrency}, settings=SETTINGS)
    with ray_replicas(layout, spec) as handle, BackgroundServer(ReplicaFront(handle, SETTINGS)) as server:
        wait_ready(server.url, replicas)
        return measure(server.url, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cpus", type=int, default=2, help="cores every setup gets in all (default 2)")
    args = parser.parse_args()
    target = default_target()
    options = {"target": target, "drafter": default_drafter(target)}
    half = args.cpus / 2
    rates = {
        "one engine, no Ray (1 torch thread)": one_engine(options, args),
        "1 replica x 1 CPU": on_replicas(options, args, 1, 1.0),
        f"1 replica x {args.cpus} CPUs": on_replicas(options, args, 1, args.cpus),
        f"2 replicas x {half:g} CPUs": on_replicas(options, args, 2, half),
    }
    base = rates["1 replica x 1 CPU"]
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores (load average "
        f"{os.getloadavg()[0]:.1f}: shared), torch {torch.__version__}; bundled pair, DFlash; "
        f"c={args.concurrency}, {args.requests} requests x {args.max_tokens} tokens, greedy, SSE\n"
    )
    print("| setup | tokens/s | vs 1 replica x 1 CPU |\n| --- | ---: | ---: |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
