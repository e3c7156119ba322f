"""Driving an AsyncEngine in tests: collect a stream, run requests concurrently, wait until drained.

Shared by the CPU engine tests and the CUDA ones (tests/cuda).
"""

from __future__ import annotations

import anyio

DRAINED = dict(live_sequences=0, waiting=0, pending_demands=0, kv_bytes=0, claimed_experts=0)


async def collect(stream):
    ids, text, last = [], "", None
    async for out in stream:
        ids += out.token_ids
        text += out.text
        last = out
    return ids, text, last


async def run_all(engine, requests):
    """Run (prompt, params) requests concurrently; return each (ids, text, last output)."""
    results = [None] * len(requests)

    async def one(i, prompt, params):
        results[i] = await collect(engine.generate(prompt, params))

    async with anyio.create_task_group() as tg:
        for i, (prompt, params) in enumerate(requests):
            tg.start_soon(one, i, prompt, params)
    return results


async def drained(engine, timeout=20.0):
    """The engine's stats once nothing is live or waiting (asserting everything was released)."""
    with anyio.fail_after(timeout):
        while engine.stats().live_sequences or engine.stats().waiting:
            await anyio.sleep(0.01)
    stats = engine.stats()
    assert {k: getattr(stats, k) for k in DRAINED} == DRAINED
    return stats
