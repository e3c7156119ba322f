"""Offloaded experts on CUDA: pinned host store, the prefetch lane's copy stream, load and reader
events; outputs identical to resident experts with real bytes over the real host-to-device link."""

import contextlib
import threading

import pytest
import torch

from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET
from pdflash.offload import Priority
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.config import ModelConfig
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 63)), [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def resident(tiny_target, device):
    return load_target(tiny_target, dtype="float32", device=device)


@pytest.fixture(scope="module")
def expected(resident):
    return [generate_autoregressive(resident.model, p, GREEDY).token_ids for p in PROMPTS]


def prompt_logits(model, prompt) -> torch.Tensor:
    return model.forward([torch.tensor(prompt)], [model.new_cache()]).logits.cpu()  # [T, V]


def test_offloaded_on_cuda_equals_resident_through_pinned_memory(resident, expected, offloaded, device, cuda_only):
    loaded = offloaded(device=device, dtype="float32", expert_cache_fraction=0.25)
    provider, store = loaded.model.experts, loaded.model.experts.store
    assert store.pinned == len(store.keys), "every expert is held in pinned host memory"
    assert all(store.expert(k).gate.is_pinned() and store.expert(k).down.is_pinned() for k in store.keys)
    assert (
        provider.link.label == "device" and provider.arena.tensors["gate"].is_cuda and provider.lane.stream is not None
    )
    for prompt, want in zip(PROMPTS, expected):
        torch.testing.assert_close(
            prompt_logits(loaded.model, prompt), prompt_logits(resident.model, prompt), rtol=0, atol=1e-5
        )
        assert generate_autoregressive(loaded.model, prompt, GREEDY).token_ids == want
    assert 1e8 < provider.link_bytes_per_s < 1e13, "a real link's rate is measured at start (bytes/s)"
    stats = provider.stats()
    assert stats["link"] == "device" and stats["misses"] > 0 and stats["evictions"] > 0
    assert stats["expert_bytes_fetched"] == stats["fetches"] * store.nbytes((0, 0))  # tiny experts: one size


def test_slots_hold_the_checkpoint_bytes_after_the_copy(offloaded, device):
    loaded = offloaded(device=device, dtype="float32", expert_cache_fraction=0.5)
    provider, store = loaded.model.experts, loaded.model.experts.store
    generate_autoregressive(loaded.model, PROMPTS[1], GREEDY)
    resident_keys = sorted(provider.resident())
    assert resident_keys
    for layer, expert in resident_keys:
        waves = provider.waves(layer, [expert])
        wave = next(waves)  # waits for the expert's load event on this stream
        slot = int(wave.slot_of_expert[expert])
        host = store.expert((layer, expert))
        for device_tensor, host_tensor in ((wave.gate, host.gate), (wave.up, host.up), (wave.down, host.down)):
            assert torch.equal(device_tensor[slot].cpu(), host_tensor)
        waves.close()


def test_a_two_expert_cache_under_concurrent_streams_keeps_every_output(
    tiny_target, resident, expected, offloaded, device
):
    """Slots are overwritten only after every stream that computed on them is done (reader events)."""
    config = ModelConfig.from_file(tiny_target / "config.json")
    two_experts = 2 * 3 * config.moe_intermediate_size * config.hidden_size * 4  # float32 slots
    loaded = offloaded(device=device, dtype="float32", expert_cache_bytes=two_experts)
    assert loaded.model.experts.num_slots == 2
    prompts = PROMPTS * 2
    got = [None] * len(prompts)

    def decode(i):
        own_stream = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
        with own_stream:
            got[i] = generate_autoregressive(loaded.model, prompts[i], GREEDY).token_ids

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [expected[i % len(PROMPTS)] for i in range(len(prompts))]
    assert loaded.model.experts.stats()["evictions"] > 0


def test_dflash_offloaded_with_route_ahead_equals_resident_decoding(bundled_fp32, code_prompts, offloaded, device):
    """The bundled pair (stored fp16, computed fp32: converted on the device after the copy)."""
    loaded = offloaded(BUNDLED_TARGET, device=device, dtype="float32", expert_cache_fraction=0.25)
    provider = loaded.model.experts
    spec = Speculator(
        loaded.model,
        load_drafter(BUNDLED_DRAFTER, loaded.model),
        expert_nbytes=loaded.expert_nbytes,
        resident=provider.resident,
    )
    resident_model = bundled_fp32.loaded.model
    for prompt in code_prompts[:2]:
        session = spec.begin_session(prompt, GREEDY)
        while not session.finished:
            draft = spec.draft_round(session)
            provider.prefetch(draft.expert_union, Priority.ROUTE_AHEAD)
            spec.verify_round(session)
        assert tuple(session.emitted) == generate_autoregressive(resident_model, prompt, GREEDY).token_ids
        assert max(session.acceptance_lengths) > 1
        spec.release(session)
    stats = provider.stats()
    assert stats["prefetch_fetches"] > 0 and stats["fetch_errors"] == 0 and stats["misses"] > 0


def test_prefetch_lane_jobs_run_on_its_copy_stream(offloaded, device, cuda_only):
    provider = offloaded(device=device, dtype="float32", expert_cache_fraction=0.25).model.experts
    seen = []
    for _ in range(3):
        provider.lane.submit(Priority.BACKGROUND, lambda: seen.append(torch.cuda.current_stream(device)))
    assert provider.lane.wait_idle(timeout=30)
    assert seen == [provider.lane.stream] * 3
    assert torch.cuda.current_stream(device) != provider.lane.stream  # the caller's stream is untouched
