"""The engine on CUDA: 32 concurrent requests equal each alone (resident and offloaded over the
real link), and every lane call runs on its lane's own stream, entered inside the call."""

import threading

import anyio
import pytest
import torch
from engine_cases import drained, run_all

from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET
from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.config import EngineConfig
from pdflash.engine.lanes import Lane
from pdflash.sampling import SamplingParams
from pdflash.spec.speculator import Speculator
from pdflash.target.generate import generate_autoregressive

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def requests(code_prompts):
    return [(code_prompts[i % len(code_prompts)] + [i + 1], SamplingParams(max_tokens=8 + i % 9)) for i in range(32)]


@pytest.fixture(scope="module")
def alone(bundled_fp32, requests):
    """Each request's greedy tokens decoded alone on the device: the oracle."""
    model = bundled_fp32.loaded.model
    return [list(generate_autoregressive(model, prompt, params).token_ids) for prompt, params in requests]


def engine_over(pair) -> AsyncEngine:
    speculator = Speculator(pair.loaded.model, pair.drafter, expert_nbytes=pair.loaded.expert_nbytes)
    return AsyncEngine(speculator, pair.loaded.tokenizer, EngineConfig())


@pytest.mark.asyncio
async def test_32_concurrent_requests_on_the_device_equal_each_alone(bundled_fp32, requests, alone):
    async with engine_over(bundled_fp32) as engine:
        results = await run_all(engine, requests)
        stats = await drained(engine, timeout=120)
    assert [ids for ids, _, _ in results] == alone
    assert stats.finished == 32 and stats.failed == stats.aborted == 0
    assert max(stats.verify_batch_sizes) > 1 and stats.mean_acceptance_length > 1


@pytest.mark.asyncio
async def test_32_concurrent_offloaded_requests_over_the_real_link_equal_each_alone(requests, alone, device):
    offload = {"expert_cache_fraction": 0.25}
    engine = AsyncEngine.from_pretrained(
        BUNDLED_TARGET, BUNDLED_DRAFTER, dtype="float32", device=str(device), offload=offload
    )
    async with engine:
        results = await run_all(engine, requests)
        stats = await drained(engine, timeout=120)
    assert [ids for ids, _, _ in results] == alone
    assert stats.prefetch_requests > 0 and stats.prefetch_errors == 0
    expected_link = "device" if device.type == "cuda" else "none"
    assert stats.provider["link"] == expected_link and stats.provider["expert_bytes_fetched"] > 0


@pytest.mark.asyncio
async def test_engine_lane_calls_run_on_the_lanes_streams(bundled_fp32, requests, cuda_only):
    engine = engine_over(bundled_fp32)
    seen: dict[str, set] = {"begin_sessions": set(), "draft_rounds": set(), "verify_rounds": set()}
    threads = set()

    def recording(name):
        method = getattr(engine.speculator, name)

        def run(*args):
            seen[name].add(torch.cuda.current_stream())
            threads.add(threading.get_ident())
            return method(*args)

        return run

    for name in seen:
        setattr(engine.speculator, name, recording(name))  # the instance attribute shadows the method
    async with engine:
        await run_all(engine, requests[:8])
    streams = set().union(*seen.values())
    assert all(seen.values()) and len(streams) == 1, f"calls ran on several streams: {seen}"
    assert streams != {torch.cuda.default_stream()}, "model calls ran on the default stream, not the lane's"
    assert threading.get_ident() not in threads, "model calls ran on the event loop's thread"


@pytest.mark.asyncio
async def test_a_lane_enters_its_stream_in_every_call_whatever_thread_submits(device, cuda_only):
    lane = Lane("test", device)
    try:
        # anyio's worker threads change from call to call: submit from several of them
        streams = [
            await anyio.to_thread.run_sync(lambda: lane.submit(torch.cuda.current_stream).result()) for _ in range(6)
        ]
        streams.append(await lane.run(torch.cuda.current_stream))
    finally:
        lane.close()
    assert streams == [lane.stream] * 7
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is untouched
