"""Expert offloading: identical outputs at any cache size, the budget and pins under concurrency,
exact fetched bytes, lane priorities, corrupt experts confined to the forward that needs them."""

import json
import re
import struct
import threading
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from pdflash.offload import (
    POLICIES,
    ExpertFetchError,
    HostExpertStore,
    Link,
    OffloadedExperts,
    Priority,
    host_store,
    make_policy,
)
from pdflash.offload.link import measure_bytes_per_s
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.speculator import Speculator
from pdflash.target.checkpoint import Checkpoint, expert_byte_map, expert_tensor_name
from pdflash.target.config import ModelConfig
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter, write_tiny_target

PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 63))]
GREEDY = SamplingParams(max_tokens=16)
HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def resident(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target, block_size=8)


@pytest.fixture(scope="module")
def config(tiny_target):
    return ModelConfig.from_file(tiny_target / "config.json")


@pytest.fixture(scope="module")
def store(tiny_target, config):
    return HostExpertStore(Checkpoint(tiny_target), config)


def provider_over(store, config, **kw) -> OffloadedExperts:
    return OffloadedExperts(store, config, dtype=torch.float32, **kw)


def prompt_logits(model, prompt) -> torch.Tensor:
    return model.forward([torch.tensor(prompt)], [model.new_cache()]).logits  # [T, V]


# -- outputs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(resident):
    """Greedy tokens of the resident target (offloading off): the reference every run must equal."""
    return {tuple(p): generate_autoregressive(resident.model, p, GREEDY).token_ids for p in PROMPTS}


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_offloaded_autoregressive_equals_resident(resident, expected, offloaded, fraction):
    loaded = offloaded(expert_cache_fraction=fraction)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            prompt_logits(loaded.model, prompt), prompt_logits(resident.model, prompt), rtol=0, atol=1e-5
        )
        assert generate_autoregressive(loaded.model, prompt, GREEDY).token_ids == expected[tuple(prompt)]
    assert loaded.model.experts.stats()["misses"] > 0


@pytest.mark.parametrize("fraction", [0.1, 0.5])
@pytest.mark.parametrize("route_ahead", [False, True])
def test_offloaded_speculative_equals_resident_autoregressive(expected, offloaded, drafter_dir, fraction, route_ahead):
    loaded = offloaded(expert_cache_fraction=fraction)
    provider = loaded.model.experts
    spec = Speculator(
        loaded.model,
        load_drafter(drafter_dir, loaded.model),
        expert_nbytes=loaded.expert_nbytes,
        block_size=8,
        resident=provider.resident,
    )
    for prompt in PROMPTS:
        session = spec.begin_session(prompt, GREEDY)
        while not session.finished:
            draft = spec.draft_round(session)
            if route_ahead:
                provider.prefetch(draft.expert_union, Priority.ROUTE_AHEAD)
            spec.verify_round(session)
        assert tuple(session.emitted) == expected[tuple(prompt)]
        spec.release(session)
    assert (provider.stats()["prefetch_fetches"] > 0) == route_ahead


def test_concurrent_forwards_share_a_two_expert_cache(expected, offloaded, store):
    loaded = offloaded(expert_cache_bytes=2 * store.nbytes((0, 0)))
    prompts = PROMPTS * 2
    got = [None] * len(prompts)

    def decode(i):
        got[i] = generate_autoregressive(loaded.model, prompts[i], GREEDY).token_ids

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == [expected[tuple(p)] for p in prompts]
    assert loaded.model.experts.stats()["expert_cache_slots"] == 2


def test_speculator_fetch_bytes_exclude_resident_experts(offloaded, drafter_dir):
    loaded = offloaded(expert_cache_fraction=0.5)
    spec = Speculator(
        loaded.model,
        load_drafter(drafter_dir, loaded.model),
        expert_nbytes=loaded.expert_nbytes,
        block_size=8,
        resident=loaded.model.experts.resident,
    )
    session = spec.begin_session(PROMPTS[1], GREEDY)
    resident = loaded.model.experts.resident()
    draft = spec.draft_round(session)
    assert resident, "the prefill left experts resident"
    assert draft.fetch_bytes == sum(loaded.expert_nbytes[k] for k in draft.expert_union - resident)
    assert draft.fetch_bytes < draft.expert_bytes


def test_mixed_stored_dtypes_compute_identically(tmp_path, offloaded):
    directory = mixed_dtype_target(tmp_path)
    loaded = offloaded(directory, expert_cache_fraction=0.25)
    reference = load_target(directory)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            prompt_logits(loaded.model, prompt), prompt_logits(reference.model, prompt), rtol=0, atol=1e-5
        )


# -- budget, pins, bytes -------------------------------------------------------------------------
@settings(max_examples=25, **HYPOTHESIS)
@given(data=st.data())
def test_cache_stays_in_budget_and_pinned_experts_survive_concurrency(store, config, data):
    E, layers = config.num_experts, list(config.moe_layer_ids)
    slots = data.draw(st.integers(2, 10), label="slots")
    slow_link = data.draw(st.booleans(), label="slow link")  # fetches that stay in flight while others run
    provider = provider_over(
        store,
        config,
        expert_cache_bytes=slots * 3 * 32 * 64 * 4 + 7,
        policy=data.draw(st.sampled_from(sorted(POLICIES)), label="policy"),
        link_gbps=100.0 if slow_link else None,
        link_latency_s=2e-4 if slow_link else 0.0,
    )
    waves_op = st.tuples(
        st.just("waves"),
        st.sampled_from(layers),
        st.lists(st.integers(0, E - 1), min_size=1, max_size=E, unique=True),
        st.booleans(),
    )
    prefetch_op = st.tuples(
        st.just("prefetch"),
        st.lists(st.tuples(st.sampled_from(layers), st.integers(0, E - 1)), max_size=10),
        st.sampled_from([Priority.ROUTE_AHEAD, Priority.BACKGROUND]),
        st.booleans(),
    )
    programs = data.draw(
        st.lists(st.lists(st.one_of(waves_op, prefetch_op), min_size=1, max_size=6), min_size=2, max_size=3),
        label="programs",
    )
    failures = []

    def run(program):
        try:
            for kind, where, what, pause in program:
                if kind == "prefetch":
                    provider.prefetch(where, what)
                    continue
                covered = []
                for wave in provider.waves(where, what):
                    experts = (wave.slot_of_expert >= 0).nonzero().flatten().tolist()
                    if pause:
                        time.sleep(0.001)  # let the other threads fetch and evict while this wave is pinned
                    assert {(where, e) for e in experts} <= provider.resident()
                    for e in experts:
                        slot, host = int(wave.slot_of_expert[e]), store.expert((where, e))
                        assert torch.equal(wave.gate[slot], host.gate) and torch.equal(wave.up[slot], host.up)
                        assert torch.equal(wave.down[slot], host.down)
                    covered += experts
                assert sorted(covered) == sorted(what)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a forward hung"
    assert provider.lane.wait_idle(timeout=20)
    provider.close()
    if failures:
        raise failures[0]
    stats = provider.stats()
    assert stats["expert_cache_peak_bytes"] <= stats["expert_cache_bytes"]
    assert sum(t.nbytes for t in provider.arena.tensors.values()) <= stats["expert_cache_bytes"]
    assert all(entry.pins == 0 for entry in provider._slots.entries.values())


@settings(max_examples=20, **HYPOTHESIS)
@given(data=st.data())
def test_bytes_fetched_are_byte_map_sums_of_lru_misses(mixed_store, data):
    """Single-expert forwards make the cache a textbook LRU: its misses are the oracle's."""
    store, config, byte_map = mixed_store
    slots = data.draw(st.integers(2, 8), label="slots")
    needs = data.draw(st.lists(st.sampled_from(sorted(byte_map)[:24]), min_size=1, max_size=60), label="needs")
    provider = provider_over(store, config, expert_cache_bytes=slots * 3 * 32 * 64 * 4, policy="lru")
    for layer, expert in needs:
        assert len(list(provider.waves(layer, [expert]))) == 1
    provider.close()
    lru, misses = OrderedDict(), []
    for key in needs:
        if key in lru:
            lru.move_to_end(key)
            continue
        misses.append(key)
        lru[key] = None
        if len(lru) > slots:
            lru.popitem(last=False)
    stats = provider.stats()
    assert stats["misses"] == len(misses) and stats["hits"] == len(needs) - len(misses)
    assert stats["expert_bytes_fetched"] == stats["miss_bytes"] == sum(byte_map[k] for k in misses)
    assert stats["evictions"] == max(0, len(misses) - slots)


def test_repeated_prompt_hits_fully_with_a_large_cache(offloaded):
    loaded = offloaded(expert_cache_fraction=1.0)
    provider = loaded.model.experts
    prompt_logits(loaded.model, PROMPTS[1])
    assert provider.stats()["expert_cache_hit_rate"] < 1.0
    provider.reset_stats()
    prompt_logits(loaded.model, PROMPTS[1])
    stats = provider.stats()
    assert stats["expert_cache_hit_rate"] == 1.0 and stats["misses"] == 0 and stats["expert_bytes_fetched"] == 0


# -- the lane --------------------------------------------------------------------------------------
def test_on_demand_fetch_overtakes_queued_background_prefetch(store, config):
    provider = provider_over(store, config, expert_cache_fraction=1.0, link_gbps=100.0, link_latency_s=0.02)
    background = [(layer, e) for layer in config.moe_layer_ids[1:] for e in range(8)]  # 24 fetches, ~0.5 s
    provider.prefetch(background, Priority.BACKGROUND)
    landed_before = len(provider.resident() & set(background))
    first = next(provider.waves(config.moe_layer_ids[0], [3]))
    landed_after = len(provider.resident() & set(background))
    assert int(first.slot_of_expert[3]) >= 0
    # at most the background fetch in flight when the need arrived, and the one started after it
    assert landed_after - landed_before <= 2 < len(background)
    provider.close()


def test_route_ahead_prefetch_is_covered_and_claimed(store, config):
    provider = provider_over(store, config, expert_cache_bytes=4 * 3 * 32 * 64 * 4)
    union = [(layer, e) for layer in config.moe_layer_ids for e in (0, 1)]  # 8 keys, 4 slots
    claim = provider.prefetch(union)
    assert claim.queued == 8
    assert provider.lane.wait_idle(timeout=10)
    stats = provider.stats()
    assert provider.resident() == set(sorted(union)[:4]), "earliest layers first, and no prefetch evicts its own"
    assert stats["prefetch_fetches"] == 4 and stats["prefetch_dropped"] == 0 and stats["evictions"] == 0
    layer = config.moe_layer_ids[0]
    list(provider.waves(layer, [0, 1]))  # not inside forward_of: the claims stay, and so the 4 keys wait
    assert provider.stats()["prefetch_coverage"] == 1.0 and provider.stats()["misses"] == 0
    assert provider.lane.wait_idle(timeout=10) and provider.stats()["prefetch_fetches"] == 4
    provider.release(claim)  # the verify ran: what still waits is dropped, not fetched
    assert provider.lane.wait_idle(timeout=10)
    stats = provider.stats()
    assert stats["prefetch_fetches"] == 4 and stats["prefetch_dropped"] == 4 and stats["claimed_experts"] == 0
    list(provider.waves(config.moe_layer_ids[2], [5, 6, 7, 8]))  # evicts layer 1's prefetched experts unused
    stats = provider.stats()
    assert stats["prefetch_waste_bytes"] == 2 * store.nbytes((1, 0))
    assert stats["prefetch_coverage"] == pytest.approx(2 / 6)
    provider.close()


def test_a_forward_leaving_a_layer_gives_its_slots_to_the_keys_that_wait(store, config):
    """A claim ends layer by layer as its verify's forward passes (`forward_of`): with a cache
    of half the union, the keys that waited are fetched into the slots of the layers behind
    the forward, so every layer finds its experts (without it, the last two layers miss)."""
    provider = provider_over(store, config, expert_cache_bytes=4 * 3 * 32 * 64 * 4)
    union = [(layer, e) for layer in config.moe_layer_ids for e in (0, 1)]  # 8 keys, 4 slots
    claim = provider.prefetch(union)
    assert provider.lane.wait_idle(timeout=10)
    with provider.forward_of([claim]):
        for layer in config.moe_layer_ids:
            list(provider.waves(layer, [0, 1]))
            assert provider.lane.wait_idle(timeout=10)
    stats = provider.stats()
    assert stats["misses"] == 0 and stats["prefetch_fetches"] == 8 and stats["prefetch_coverage"] == 1.0
    assert stats["prefetch_dropped"] == 0 and stats["prefetch_waste_bytes"] == 0
    provider.release(claim)
    assert provider.stats()["claimed_experts"] == 0
    provider.close()


def test_one_launch_s_claims_are_fetched_layer_by_layer_across_its_verifies(store, config):
    """A batched verify computes every verify's layer l before any layer l + 1, so the claims of
    one launch share a number: with room for half of two verifies' unions, the lane fetches
    both verifies' first layers (one prefetch per verify would have fetched the first verify's
    every layer before the second's first)."""
    provider = provider_over(store, config, expert_cache_bytes=4 * 3 * 32 * 64 * 4)  # 4 slots
    layers = config.moe_layer_ids
    first, second = ([(layer, e) for layer in layers] for e in (0, 1))  # 4 keys each, one per layer
    claims = provider.prefetch_launch([first, second])
    assert [c.queued for c in claims] == [4, 4] and claims[0].order == claims[1].order
    assert provider.lane.wait_idle(timeout=10)
    assert provider.resident() == {(layer, e) for layer in layers[:2] for e in (0, 1)}
    provider.close()
    apart = provider_over(store, config, expert_cache_bytes=4 * 3 * 32 * 64 * 4)
    for union in (first, second):
        apart.prefetch(union)
    assert apart.lane.wait_idle(timeout=10) and apart.resident() == set(first)
    apart.close()


def test_emulated_link_time_is_exposed_and_labelled(store, config):
    provider = provider_over(store, config, expert_cache_fraction=0.5, link_gbps=1.0, link_latency_s=0.01)
    list(provider.waves(0, [0, 1, 2]))
    stats = provider.stats()
    assert stats["link"] == "emulated"
    assert stats["exposed_fetch_s"] >= 0.9 * 3 * provider.link.transfer_s(store.nbytes((0, 0)))
    assert provider.exposed_fetch_s == stats["exposed_fetch_s"]  # the pacer's cheap read of the same figure
    provider.close()


def test_link_busy_time_is_the_pipes_time_for_prefetches_and_misses_alike(store, config):
    provider = provider_over(store, config, expert_cache_fraction=1.0, link_gbps=1.0, link_latency_s=0.01)
    each_s = provider.link.transfer_s(store.nbytes((0, 0)))
    provider.prefetch([(1, 0), (1, 1)])
    assert provider.lane.wait_idle(timeout=10)
    list(provider.waves(0, [0, 1, 2]))  # three misses
    busy_s = provider.stats()["link_busy_s"]
    assert 5 * each_s * 0.9 <= busy_s <= 5 * each_s + 0.5  # five fetches; the bound above: the lane's own steps
    list(provider.waves(0, [0, 1, 2]))  # all hits: the link carries nothing more
    assert provider.stats()["link_busy_s"] == busy_s
    provider.reset_stats()
    assert provider.stats()["link_busy_s"] == 0.0
    provider.close()
    with provider_over(store, config, expert_cache_fraction=0.5) as plain:
        assert plain.stats()["link"] == "none"
        assert plain.link_bytes_per_s is None  # host memory is the device tier: copies cost no link time
    assert provider.link_bytes_per_s == 1e9  # emulated: its bandwidth, never a measurement


def test_a_real_link_is_measured_by_timed_copies_after_a_warm_up(caplog):
    """The rate a real link is priced at: the bytes of the copies after the first over the time
    between synchronizes (here copies that take a known time)."""
    moved = []

    def copy(nbytes, seconds):
        def run():
            time.sleep(seconds)
            moved.append(nbytes)

        return run

    copies = [copy(10**9, 0.2), copy(10**6, 0.02), copy(3 * 10**6, 0.02)]  # a slow warm-up, then 4 MB in 40 ms
    rate = measure_bytes_per_s(copies, [10**9, 10**6, 3 * 10**6], synchronize=lambda: None)
    assert moved == [10**9, 10**6, 3 * 10**6]
    assert 4e6 / 0.06 < rate <= 4e6 / 0.04  # the warm-up is not counted; sleeps only overshoot
    assert measure_bytes_per_s(copies[:1], [1], synchronize=lambda: None) is None  # nothing after the warm-up

    def broken():
        raise RuntimeError("copy engine gone")

    with caplog.at_level("WARNING"):
        assert measure_bytes_per_s([copies[1], broken], [1, 1], synchronize=lambda: None) is None
    assert "measuring the host-to-device link failed" in caplog.text


# -- failures ------------------------------------------------------------------------------------
@pytest.mark.parametrize("corruption", ["nan-tensor", "inf-bytes"])
def test_corrupt_expert_fails_only_the_forward_that_needs_it(resident, offloaded, tmp_path, corruption):
    layer, victim, prompt_a, prompt_b = routing_split(resident.model, layer=1)
    name = expert_tensor_name(layer, victim, "up_proj")
    directory = write_tiny_target(tmp_path / "corrupt", seed=0)  # the same weights as `resident`
    corrupt(directory / "model.safetensors", name, corruption)
    loaded = offloaded(directory, expert_cache_fraction=0.5)
    provider = loaded.model.experts
    message = rf"expert \(layer {layer}, expert {victim}\).*{re.escape(name)}.*NaN or infinite"
    with pytest.raises(ExpertFetchError, match=message):
        prompt_logits(loaded.model, prompt_a)
    assert (layer, victim) not in provider.resident()
    assert all(entry.pins == 0 for entry in provider._slots.entries.values())
    torch.testing.assert_close(
        prompt_logits(loaded.model, prompt_b), prompt_logits(resident.model, prompt_b), rtol=0, atol=1e-5
    )
    with pytest.raises(ExpertFetchError, match=message):  # not left half-resident: fetched again, fails again
        prompt_logits(loaded.model, prompt_a)
    assert provider.stats()["fetch_errors"] == 2


def test_budget_below_two_experts_is_rejected(store, config):
    with pytest.raises(
        ValueError,
        match=r"budget of 30000 bytes holds 1 expert\(s\) of 24576 bytes .*"
        r"the minimum is 2 experts = 49152 bytes",
    ):
        provider_over(store, config, expert_cache_bytes=30_000)


def test_cache_size_is_given_once_and_in_range(store, config):
    with pytest.raises(ValueError, match="exactly one of expert_cache_bytes or expert_cache_fraction"):
        provider_over(store, config)
    with pytest.raises(ValueError, match=r"expert_cache_fraction must be in \(0, 1\], got 1.5"):
        provider_over(store, config, expert_cache_fraction=1.5)
    with pytest.raises(ValueError, match="link_gbps must be > 0"):
        Link.for_device(torch.device("cpu"), gbps=0.0, latency_s=0.0)


def test_unknown_eviction_policy_is_named(store, config):
    with pytest.raises(ValueError, match="eviction policy 'random' is unknown; choose one of lru, lfu, activation"):
        provider_over(store, config, expert_cache_fraction=0.5, policy="random")


def test_pinning_failure_falls_back_to_mapped_pages(tiny_target, config, store, monkeypatch):
    if torch.cuda.is_available():  # pinning succeeds there: fail it as a CPU-only torch does

        def refuse(expert):
            raise RuntimeError("Cannot access accelerator device when none is available.")

        monkeypatch.setattr(host_store, "_pinned", refuse)
    with pytest.warns(RuntimeWarning, match="pinning host memory failed after 0 of 64 experts"):
        fallback = HostExpertStore(Checkpoint(tiny_target), config, pin=True)
    assert fallback.pinned == 0 and torch.equal(fallback.expert((2, 3)).down, store.expert((2, 3)).down)


def test_host_store_serves_the_checkpoint_bytes(tiny_target, config, store):
    checkpoint = Checkpoint(tiny_target)
    byte_map = expert_byte_map(checkpoint, config)
    for key in [(0, 0), (3, 15), (2, 7)]:
        expert = store.expert(key)
        name = expert_tensor_name(*key, "gate_proj")
        assert torch.equal(expert.gate, checkpoint.load(name, (32, 64), torch.float32))
        assert expert.nbytes == store.nbytes(key) == byte_map[key]


def test_prefetch_rejects_on_demand_priority_and_unknown_experts(store, config):
    with provider_over(store, config, expert_cache_fraction=0.5) as provider:
        with pytest.raises(ValueError, match="priority must be ROUTE_AHEAD or BACKGROUND"):
            provider.prefetch([(0, 1)], Priority.ON_DEMAND)
        with pytest.raises(ValueError, match=r"unknown experts \[\(0, 99\)\]"):
            provider.prefetch([(0, 99)])


# -- policies ------------------------------------------------------------------------------------
def test_policies_evict_the_least_recent_least_frequent_least_active():
    lru, lfu, active = make_policy("lru"), make_policy("lfu"), make_policy("activation")
    for policy in (lru, lfu, active):
        for union in ([0, 1], [0], [0], [1, 2], [2]):
            policy.observe(5, union)
    candidates = [(5, 0), (5, 1), (5, 2)]
    assert min(candidates, key=lru.score) == (5, 0)  # 0 last routed third of five
    assert min(candidates, key=lfu.score) == (5, 1)  # counts 3, 2, 2: 1 is older than 2
    assert min(candidates, key=active.score) == (5, 1)  # decayed: 0 ~ 2.20, 1 ~ 1.56, 2 ~ 1.90
    active.observe(5, [1])
    active.observe(6, [0])  # another layer's history leaves layer 5 alone
    assert min(candidates, key=active.score) == (5, 2)


def test_activation_ties_evict_the_most_recently_routed():
    """Equal histories in two layers: the layer routed last is needed again last, so it goes first."""
    active = make_policy("activation")
    for _ in range(3):
        active.observe(0, [0, 1])
        active.observe(1, [0, 1])
    assert min([(0, 0), (1, 0)], key=active.score) == (1, 0)


@pytest.mark.parametrize("policy, hits_per_scan", [("activation", 8), ("lru", 0)])
def test_a_scan_larger_than_the_cache_keeps_what_fits(store, config, policy, hits_per_scan):
    """Every forward routes every expert of every MoE layer (a large batch): 4 x 16 experts
    through 24 slots. One layer's 16 are pinned while it computes, so at most the other 8
    slots can survive a scan (Belady's bound); least-recent order keeps none of them."""
    slots, experts = 24, range(config.num_experts)
    provider = provider_over(store, config, expert_cache_bytes=slots * store.nbytes((0, 0)), policy=policy)

    def scan():
        for layer in config.moe_layer_ids:
            list(provider.waves(layer, list(experts)))

    scan(), scan()
    provider.reset_stats()
    for _ in range(4):
        scan()
    assert provider.stats()["hits"] == 4 * hits_per_scan
    provider.close()


# -- helpers -------------------------------------------------------------------------------------
def mixed_dtype_target(directory):
    """The tiny checkpoint with odd experts stored in bfloat16 and one expert mixed: unequal byte-map entries."""
    write_tiny_target(directory, seed=3)
    tensors = load_file(directory / "model.safetensors")
    for name in tensors:
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if m and (int(m[2]) % 2 or (int(m[1]), int(m[2]), m[3]) == (0, 4, "down_proj")):
            tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    directory = mixed_dtype_target(tmp_path_factory.mktemp("mixed"))
    config, checkpoint = ModelConfig.from_file(directory / "config.json"), Checkpoint(directory)
    byte_map = expert_byte_map(checkpoint, config)
    assert len(set(byte_map.values())) == 3
    return HostExpertStore(checkpoint, config), config, byte_map


def routing_split(model, *, layer: int):
    """An expert of `layer`, a one-token prompt that routes to it and one that does not."""
    routed = [routed_ids(model, [t]) for t in range(20)]  # [1, L_moe, K] each
    index = model.moe_index[layer]
    victim = int(routed[0][0, index, 0])
    other = next(t for t, r in enumerate(routed) if victim not in r[0, index].tolist())
    return layer, victim, [0], [other]


def routed_ids(model, prompt) -> torch.Tensor:
    return model.forward([torch.tensor(prompt)], [model.new_cache()]).routed


def corrupt(file, name: str, how: str) -> None:
    if how == "nan-tensor":
        tensors = load_file(file)
        tensors[name][3, 5] = float("nan")
        save_file(tensors, str(file))
        return
    with open(file, "r+b") as handle:  # overwrite the first element's bytes in place with +inf
        (header_len,) = struct.unpack("<Q", handle.read(8))
        start = json.loads(handle.read(header_len))[name]["data_offsets"][0]
        handle.seek(8 + header_len + start)
        handle.write(struct.pack("<f", float("inf")))
