"""A bounded load test on loopback: 100 websocket clients x 2 concurrent generations each.

Every generation must complete with the same tokens the prompt gets alone (greedy), with no
error message and no server error logged; afterwards no sequence is live, no socket is
open, and the process RSS is back near where it started."""

import asyncio
import gc
import json
import logging
import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app

CLIENTS = 100
PER_CLIENT = 2
MAX_TOKENS = 8
PROMPTS = ["def add(a, b):", "import numpy as np", "SELECT * FROM", "Dear diary,", "fn main() {", "# TODO"]
RSS_SLACK_BYTES = 64 * 2**20  # allocator and interpreter noise after 200 requests; a leak per request is far more
TIME_LIMIT_S = 90.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def server(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, max_num_seqs=64, max_waiting=256)
    app = create_app(engine, ServerSettings(model_name="tiny", stats_interval_s=0.25))
    with BackgroundServer(app) as running:
        yield running


async def run_client(url: str, prompts: list[str]) -> dict:
    """One socket, its generations started at once; returns id -> (token ids, text, done message)."""
    async with connect(url, max_queue=None) as ws:
        for i, prompt in enumerate(prompts):
            start = {"type": "start", "id": i, "prompt": prompt, "params": {"max_tokens": MAX_TOKENS}}
            await ws.send(json.dumps(start))
        tokens = {i: [] for i in range(len(prompts))}
        text = {i: "" for i in range(len(prompts))}
        done = {}
        while len(done) < len(prompts):
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                tokens[msg["id"]] += msg["token_ids"]
                text[msg["id"]] += msg["text"]
            elif msg["type"] == "done":
                done[msg["id"]] = msg
            elif msg["type"] == "error":
                raise AssertionError(f"server error message: {msg}")
    return {i: (tokens[i], text[i], done[i]) for i in done}


async def run_clients(url: str, clients: int) -> list[dict]:
    jobs = [[PROMPTS[(c + k) % len(PROMPTS)] for k in range(PER_CLIENT)] for c in range(clients)]
    results = await asyncio.gather(*(run_client(url, prompts) for prompts in jobs))
    return list(zip(jobs, results, strict=True))


def scrape(server) -> dict:
    import httpx

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_100_clients_two_generations_each(server, caplog):
    caplog.set_level(logging.ERROR)
    # the reference: each prompt alone (one client, one generation at a time)
    reference = {}
    for prompt in PROMPTS:
        ((tokens, text, done),) = asyncio.run(run_client(server.ws_url, [prompt])).values()
        assert done["finish_reason"] == "length" and len(tokens) == MAX_TOKENS
        reference[prompt] = (tokens, text)
    asyncio.run(run_clients(server.ws_url, 20))  # warm up the allocator and the server's code paths
    gc.collect()
    rss_before = rss_bytes()

    started = time.perf_counter()
    results = asyncio.run(run_clients(server.ws_url, CLIENTS))
    elapsed = time.perf_counter() - started

    assert len(results) == CLIENTS
    for prompts, result in results:
        assert len(result) == PER_CLIENT
        for i, prompt in enumerate(prompts):
            tokens, text, done = result[i]
            assert done["finish_reason"] == "length"
            assert len(tokens) == done["metrics"]["generated_tokens"] == MAX_TOKENS
            assert (tokens, text) == reference[prompt], f"{prompt!r} under load differs from alone"
    assert elapsed < TIME_LIMIT_S, f"{CLIENTS * PER_CLIENT} generations took {elapsed:.1f} s"

    deadline = time.monotonic() + 10
    while True:
        metrics = scrape(server)
        idle = metrics["pdflash_live_sequences{}"] == 0 and metrics["pdflash_ws_connections{}"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, {k: v for k, v in metrics.items() if "live" in k or "connections" in k}
    assert metrics['pdflash_ws_generations_total{"outcome": "length"}'] == (
        len(PROMPTS) + 20 * PER_CLIENT + CLIENTS * PER_CLIENT
    )
    assert metrics.get('pdflash_ws_messages_total{"type": "invalid"}', 0) == 0
    assert metrics['pdflash_engine_requests_total{"outcome": "failed"}'] == 0
    server_errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not server_errors, [r.getMessage() for r in server_errors]

    gc.collect()
    rss_after = rss_bytes()
    assert rss_after - rss_before < RSS_SLACK_BYTES, (
        f"RSS grew by {(rss_after - rss_before) / 2**20:.1f} MiB over {CLIENTS * PER_CLIENT} generations"
    )
    print(
        f"\n{CLIENTS} clients x {PER_CLIENT} generations x {MAX_TOKENS} tokens: {elapsed:.2f} s, "
        f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
