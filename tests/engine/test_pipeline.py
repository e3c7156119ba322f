"""The pipelined engine: what overlaps with what, when ticks happen, and what an abort leaves behind.

Lanes run the real model on the tiny checkpoint; the only doubles are timing ones (a round
wrapped to take a little longer, or to wait on a gate) and, where a test needs to count
claims, a provider stand-in. Timelines come from the lanes' own busy intervals.
"""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from engine_cases import collect, drained, run_all
from test_engine import GREEDY, PROMPTS, RecordingProvider

from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.config import EngineConfig
from pdflash.measure import overlap_s
from pdflash.sampling import SamplingParams
from pdflash.spec.speculator import Speculator

LONG = SamplingParams(max_tokens=24)


async def run_staggered(engine, first, second, gap_s=0.03):
    """`second` arrives `gap_s` after `first`: two groups out of step (as arrivals are in service)."""
    results = {}

    async def group(name, prompts, delay):
        await anyio.sleep(delay)
        results[name] = await run_all(engine, [(p, LONG) for p in prompts])

    async with anyio.create_task_group() as tg:
        tg.start_soon(group, "first", first, 0.0)
        tg.start_soon(group, "second", second, gap_s)
    return [ids for ids, _, _ in results["first"] + results["second"]]


def slowed(fn, seconds, record=None):
    """`fn` taking at least `seconds` longer (a timing double); its (start, end) appended to `record`."""

    def slow(*args):
        started = time.perf_counter()
        result = fn(*args)
        time.sleep(seconds)
        if record is not None:
            record.append((started, time.perf_counter()))
        return result

    return slow


@pytest.mark.asyncio
async def test_one_group_drafts_while_the_other_verifies(make_engine, reference):
    # fixed blocks: the adaptive policy sends the random tiny drafter's sequences to plain
    # decoding (the target lane), and this is about drafts overlapping verifies (on a lane of their
    # own); prompts prefill alone, so the second group starts out of step with the first
    async with make_engine(speculation="fixed", drafter_lane="own", prefill_mode="alone") as engine:
        spec = engine.speculator
        spec.verify_rounds = slowed(spec.verify_rounds, 0.02)
        spec.draft_rounds = slowed(spec.draft_rounds, 0.02)
        results = await run_staggered(engine, PROMPTS, PROMPTS[::-1])
        running = engine._running
        assert running is not None and running.drafter is not None
        both = overlap_s(running.drafter.intervals, running.target.intervals)
        stats = await drained(engine)
    assert results == [reference(p, LONG) for p in PROMPTS + PROMPTS[::-1]]
    assert both > 0.05, f"drafts and verifies overlapped for only {both:.3f} s"
    assert stats.model_s > 0


@pytest.mark.asyncio
async def test_busy_time_counts_overlapping_drafts_and_verifies_once(make_engine):
    async with make_engine(speculation="fixed", drafter_lane="own", prefill_mode="alone") as engine:
        spec = engine.speculator
        spec.verify_rounds = slowed(spec.verify_rounds, 0.02)
        spec.draft_rounds = slowed(spec.draft_rounds, 0.02)
        started = time.perf_counter()
        await run_staggered(engine, PROMPTS, PROMPTS[::-1])
        wall = time.perf_counter() - started
        running = engine._running
        assert running is not None and running.drafter is not None
        both = overlap_s(running.drafter.intervals, running.target.intervals)
        stats = await drained(engine)
    assert both > 0.05  # the lanes overlapped: their sum (model_s) counts that twice
    assert stats.busy_s == pytest.approx(stats.model_s - both, abs=1e-6)  # |T ∪ D| = T + D - T ∩ D
    assert stats.busy_s <= wall


@pytest.mark.asyncio
async def test_the_next_batch_is_admitted_against_the_running_union_and_fetched_meanwhile(
    loaded, drafter, tiny_target, offloaded, reference
):
    target = offloaded(expert_cache_fraction=0.25, link_gbps=0.05)
    spec = Speculator(target.model, drafter, expert_nbytes=target.expert_nbytes, resident=target.model.experts.resident)
    spec.verify_rounds = slowed(spec.verify_rounds, 0.03)
    engine = AsyncEngine(spec, loaded.tokenizer, EngineConfig(), provider=target.model.experts)
    async with engine:
        results = await run_staggered(engine, PROMPTS, PROMPTS[::-1])
        stats = await drained(engine)
    assert results == [reference(p, LONG) for p in PROMPTS + PROMPTS[::-1]]
    assert stats.scheduling == "derived"
    assert stats.in_flight_tick_share > 0, "some tick charged against the running batch's union"
    assert stats.copy_compute_overlap_s > 0, "expert copies ran while the target computed"
    assert stats.provider["claimed_experts"] == 0


@pytest.mark.parametrize(("link_gbps", "drafter_lane"), [(0.05, "own"), (None, "own"), (None, "shared")])
@pytest.mark.asyncio
async def test_with_a_link_latecomers_join_the_next_launch_and_without_one_they_overlap(
    loaded, drafter, offloaded, reference, link_gbps, drafter_lane
):
    """Two groups out of step (prompts prefilled alone: riding a verify would put the second
    group in step with the first). Link-bound, a launch waits for the sequences still drafting
    (bounded by the copies under way and the drafter's measured time), so the groups merge
    and each round's experts cross the link once; resident, they stay two cohorts that
    overlap drafting with verifying, unless the drafts run on the verify lane itself, where
    waiting for them costs nothing and the groups merge again."""
    target = offloaded(expert_cache_fraction=0.25, link_gbps=link_gbps)
    spec = Speculator(target.model, drafter, expert_nbytes=target.expert_nbytes, resident=target.model.experts.resident)
    spec.draft_rounds = slowed(spec.draft_rounds, 0.02)
    provider = target.model.experts if link_gbps is not None else None
    config = EngineConfig(speculation="fixed", drafter_lane=drafter_lane, prefill_mode="alone")
    engine = AsyncEngine(spec, loaded.tokenizer, config, provider=provider)
    async with engine:
        results = await run_staggered(engine, PROMPTS, PROMPTS[::-1])
        stats = await drained(engine)
    assert results == [reference(p, LONG) for p in PROMPTS + PROMPTS[::-1]]
    mean_batch = stats.verify_rounds / sum(stats.verify_batch_sizes.values())
    if link_gbps is not None or drafter_lane == "shared":
        assert mean_batch > 0.75 * 2 * len(PROMPTS), stats.verify_batch_sizes
    else:
        assert mean_batch < 0.75 * 2 * len(PROMPTS), stats.verify_batch_sizes


@pytest.mark.asyncio
async def test_no_tick_happens_while_a_verify_runs_with_nothing_new_to_admit(make_engine, reference):
    verifies: list[tuple[float, float]] = []
    async with make_engine() as engine:
        spec = engine.speculator
        spec.verify_rounds = slowed(spec.verify_rounds, 0.02, verifies)
        results = await run_all(engine, [(p, LONG) for p in PROMPTS])
        ticks = list(engine._running.pacer.stats.tick_times)
        await drained(engine)
    assert [ids for ids, _, _ in results] == [reference(p, LONG) for p in PROMPTS]
    inside = [sum(start < t < end for t in ticks) for start, end in verifies]
    assert max(inside) <= 1, f"ticks inside one verify: {inside}"
    assert len(ticks) <= 2 * len(verifies) + 1  # one at a launch, at most one more while it runs


class Gate:
    """Holds the first call of a round until released (the round runs for real after)."""

    def __init__(self, fn):
        self.fn, self.entered, self.go = fn, threading.Event(), threading.Event()

    def __call__(self, *args):
        if not self.go.is_set():
            self.entered.set()
            self.go.wait(20)
        return self.fn(*args)


@pytest.mark.asyncio
@pytest.mark.parametrize("drafter_lane", ["own", "shared"])
@pytest.mark.parametrize("point", ["prefill", "draft", "ticket", "verify"])
async def test_an_abort_at_each_await_point_releases_kv_demand_and_claims(make_engine, reference, point, drafter_lane):
    provider = RecordingProvider()
    async with make_engine(provider=provider, drafter_lane=drafter_lane) as engine:
        spec, gate = engine.speculator, None
        if point in ("prefill", "draft", "verify"):
            name = {"prefill": "begin_sessions", "draft": "draft_rounds", "verify": "verify_rounds"}[point]
            gate = Gate(getattr(spec, name))
            setattr(spec, name, gate)
        else:  # hold admission: ticks admit nothing while the gate is shut
            real_tick, shut = engine.scheduler.tick, threading.Event()
            engine.scheduler.tick = lambda *a, **k: real_tick(*a, **k) if not shut.is_set() else _no_admission()
        doomed = engine.generate(PROMPTS[1], LONG, request_id="doomed")
        if gate is not None:
            await anyio.to_thread.run_sync(gate.entered.wait, 20)
        else:
            shut.set()
            with anyio.fail_after(20):
                while engine._seqs["doomed"].state.value != "verify":
                    await anyio.sleep(0.005)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.abort, "doomed")
            await anyio.sleep(0.05)
            if gate is not None:
                assert engine._seqs["doomed"].state.value == "aborted"  # its KV waits for the lane call using it
                gate.go.set()
            else:
                assert "doomed" not in engine._seqs  # waiting for a ticket holds no lane: released at once
                shut.clear()
        _, _, last = await collect(doomed)
        kept, _, _ = await collect(engine.generate(PROMPTS[0], GREEDY))
        stats = await drained(engine)
    assert last.finish_reason == "abort"
    assert kept == reference(PROMPTS[0])
    assert stats.aborted == 1 and stats.claimed_experts == 0 and not provider.claims


def _no_admission():
    from pdflash.engine.admission import ZERO, VerifyAdmission

    return VerifyAdmission((), (), ZERO)


@pytest.mark.asyncio
async def test_lanes_get_thread_counts_that_do_not_oversubscribe(make_engine):
    async with make_engine(drafter_lane="own") as engine:
        running = engine._running
        assert running is not None and running.drafter is not None
        threads = running.target.threads + running.drafter.threads
        assert engine.stats().drafter_lane == "own"
    import torch

    assert threads == max(2, torch.get_num_threads())


@pytest.mark.asyncio
async def test_a_shared_drafter_lane_runs_drafts_and_verifies_on_the_target_lane_with_every_thread(
    make_engine, reference
):
    async with make_engine(speculation="fixed", drafter_lane="shared") as engine:
        running = engine._running
        assert running is not None and running.drafter is None and running.draft.lane is running.target
        import torch

        assert running.target.threads == torch.get_num_threads()
        results = await run_staggered(engine, PROMPTS, PROMPTS[::-1])
        drafted_s, calls = running.draft.busy_s, running.target.calls
        stats = await drained(engine)
    assert results == [reference(p, LONG) for p in PROMPTS + PROMPTS[::-1]]
    assert stats.drafter_lane == "shared" and stats.mean_acceptance_length > 0
    assert running.draft.batches > 0 and 0 < drafted_s < stats.model_s  # drafts timed apart from verifies
    assert calls > running.draft.batches  # verifies (and prefills) ran on the same lane


@pytest.mark.asyncio
async def test_a_bug_around_one_batched_verify_fails_that_batch_only(make_engine, reference):
    async with make_engine() as engine:
        pacer = engine._running.pacer
        real, calls = pacer._verify_rounds, []

        async def broken_once(batch, ride):  # fails outside the rounds (not a round's own error) the first time
            calls.append(len(batch))
            if len(calls) == 1:
                raise RuntimeError("bug around a batch")
            return await real(batch, ride)

        pacer._verify_rounds = broken_once
        with pytest.raises(RuntimeError, match="bug around a batch"):
            await collect(engine.generate(PROMPTS[0], GREEDY))
        assert engine.running and engine.error is None
        ids, _, _ = await collect(engine.generate(PROMPTS[1], GREEDY))
        stats = await drained(engine)
    assert ids == reference(PROMPTS[1])
    assert (stats.failed, stats.finished) == (1, 1)


@pytest.mark.parametrize("link_gbps", [0.05, None])
@pytest.mark.asyncio
async def test_a_prompt_waits_for_a_sequence_about_to_reach_its_limit_only_behind_a_link(
    loaded, drafter, offloaded, reference, link_gbps
):
    """A request arriving while the seated one is expected to reach its length limit sooner than
    a prefill takes (a prefill slowed to 0.3 s, 4 tokens left at tens of ms each): with a link it
    waits for that exit, and the seated sequence keeps verifying meanwhile; resident, prefilling
    alone, it is prefilled at once (and the seated one waits behind its prefill)."""
    target = offloaded(expert_cache_fraction=0.25, link_gbps=link_gbps)
    spec = Speculator(target.model, drafter, expert_nbytes=target.expert_nbytes, resident=target.model.experts.resident)
    prefills: list[tuple[float, float]] = []
    verifies: list[tuple[float, float]] = []
    spec.begin_sessions = slowed(spec.begin_sessions, 0.3, prefills)
    spec.verify_rounds = slowed(spec.verify_rounds, 0.0, verifies)
    provider = target.model.experts if link_gbps is not None else None
    config = EngineConfig() if link_gbps is not None else EngineConfig(prefill_mode="alone")
    engine = AsyncEngine(spec, loaded.tokenizer, config, provider=provider)
    short = SamplingParams(max_tokens=6)
    results, near_limit, arrived = {}, anyio.Event(), []

    async def first():
        ids = []
        async for out in engine.generate(PROMPTS[0], short):
            ids += out.token_ids
            if len(ids) >= 2:
                near_limit.set()
        results["first"] = ids

    async def second():
        await near_limit.wait()
        arrived.append(time.perf_counter())
        results["second"], _, _ = await collect(engine.generate(PROMPTS[1], short))

    async with engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(second)
        stats = await drained(engine)
    assert results == {"first": reference(PROMPTS[0], short), "second": reference(PROMPTS[1], short)}
    assert len(prefills) == 2
    meanwhile = [v for v in verifies if arrived[0] < v[0] < prefills[1][0]]
    if link_gbps is not None:
        assert stats.prefills_held == 1
        assert meanwhile, "the seated sequence verified while the new prompt waited"
    else:
        assert stats.prefills_held == 0
        assert not meanwhile


def mixed_calls(spec, record, delay_s=0.0):
    """Wrap `spec.verify_and_begin` (every verify and prefill goes through it): (verified sequences,
    prompts) of each call appended to `record`; forwards with both in them take `delay_s` longer."""
    real = spec.verify_and_begin

    def recorded(sessions, requests, watchers=None):
        record.append((len(sessions), len(requests)))
        result = real(sessions, requests, watchers)
        if sessions and requests:
            time.sleep(delay_s)
        return result

    spec.verify_and_begin = recorded


async def run_mid_rounds(engine, first, second):
    """`second` arrives once `first` is in its rounds (its first verify has run)."""
    results = {}

    async def late():
        with anyio.fail_after(20):
            while not engine.stats().verify_rounds:
                await anyio.sleep(0.002)
        results["second"] = await run_all(engine, [(p, LONG) for p in second])

    async with anyio.create_task_group() as tg:
        tg.start_soon(late)
        results["first"] = await run_all(engine, [(p, LONG) for p in first])
    return [ids for ids, _, _ in results["first"] + results["second"]]


def link_engine(loaded, drafter, offloaded, link_gbps=0.05, **config):
    target = offloaded(expert_cache_fraction=0.25, link_gbps=link_gbps)
    spec = Speculator(target.model, drafter, expert_nbytes=target.expert_nbytes, resident=target.model.experts.resident)
    provider = target.model.experts if link_gbps is not None else None
    return AsyncEngine(spec, loaded.tokenizer, EngineConfig(**config), provider=provider)


@pytest.mark.parametrize(
    ("link_gbps", "prefill_mode", "rides"),
    [(0.05, "auto", True), (0.05, "alone", False), (None, "auto", True), (None, "alone", False)],
)
@pytest.mark.asyncio
async def test_a_prompt_arriving_mid_rounds_prefills_inside_the_next_verify(
    loaded, drafter, offloaded, reference, link_gbps, prefill_mode, rides
):
    """The second group arrives while the first is in its rounds: with a drafter ("auto", behind a
    link or resident) its prompts prefill in the forward of the first group's next verify; asked
    for "alone", in forwards of their own. Either way every output equals plain decoding."""
    engine = link_engine(loaded, drafter, offloaded, link_gbps, prefill_mode=prefill_mode)
    calls: list[tuple[int, int]] = []
    mixed_calls(engine.speculator, calls)
    async with engine:
        results = await run_mid_rounds(engine, PROMPTS, PROMPTS[::-1])
        stats = await drained(engine)
    assert results == [reference(p, LONG) for p in PROMPTS + PROMPTS[::-1]]
    assert stats.prefill_mode == ("verify" if rides else "alone")
    together = [c for c in calls if c[0] and c[1]]
    if rides:
        assert together, calls
        assert stats.prefills_in_verifies == sum(prompts for _, prompts in together) >= 1
    else:
        assert not together and stats.prefills_in_verifies == 0


@pytest.mark.asyncio
async def test_a_prompt_that_breaks_the_verify_it_rides_fails_alone(loaded, drafter, offloaded, reference):
    """A forward verifying the first group and prefilling two prompts, one of them bad, raises: the
    prompts and the sequences are retried alone, and only the request whose prompt still raises
    alone fails."""
    engine = link_engine(loaded, drafter, offloaded)
    real = engine.speculator.verify_and_begin
    poisoned = SamplingParams(max_tokens=23)  # marks the request whose prompt raises

    together: list[int] = []  # prompts of each forward that also verified

    def breaking(sessions, requests, watchers=None):
        if sessions and requests:
            together.append(len(requests))
        if any(params == poisoned for _, params in requests):
            raise RuntimeError("a prompt that breaks its forward")
        return real(sessions, requests, watchers)

    engine.speculator.verify_and_begin = breaking
    async with engine:
        first = [(p, LONG) for p in PROMPTS]
        results: dict[str, object] = {}

        async def late():
            with anyio.fail_after(20):
                while not engine.stats().verify_rounds:
                    await anyio.sleep(0.002)

            async def bad():
                with pytest.raises(RuntimeError, match="breaks its forward"):
                    await collect(engine.generate(PROMPTS[1], poisoned))

            async def fine():  # arrives with the bad one: the two ride the same verify
                results["fine"] = await collect(engine.generate(PROMPTS[2], LONG))

            async with anyio.create_task_group() as both:
                both.start_soon(bad)
                both.start_soon(fine)

        async with anyio.create_task_group() as tg:
            tg.start_soon(late)
            results["first"] = await run_all(engine, first)
        stats = await drained(engine)
        assert engine.running
    assert [ids for ids, _, _ in results["first"]] == [reference(p, LONG) for p in PROMPTS]
    assert results["fine"][0] == reference(PROMPTS[2], LONG)
    assert (stats.failed, stats.finished) == (1, len(PROMPTS) + 1)
    assert together and together[0] == 2, together  # the two rode one verify, which raised


@pytest.mark.asyncio
async def test_an_abort_while_a_prompt_rides_a_verify_releases_everything(loaded, drafter, offloaded, reference):
    """Aborted while its prefill runs inside another sequence's verify: the abort waits for that
    forward, then the request ends once (aborted) and its KV, demand and claims are gone; the
    sequence it rode with finishes as it would alone."""
    engine = link_engine(loaded, drafter, offloaded)
    calls: list[tuple[int, int]] = []
    mixed_calls(engine.speculator, calls, delay_s=0.2)
    async with engine:
        seated = {}

        async def first():
            seated["ids"], _, _ = await collect(engine.generate(PROMPTS[0], LONG))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(20):
                while not engine.stats().verify_rounds:
                    await anyio.sleep(0.002)
            stream = engine.generate(PROMPTS[3], LONG, request_id="rider")
            outputs = []

            async def ride():
                async for out in stream:
                    outputs.append(out)

            tg.start_soon(ride)
            with anyio.fail_after(10):
                while not any(c[0] and c[1] for c in calls):
                    await anyio.sleep(0.005)
            assert await engine.abort("rider")
        stats = await drained(engine)
    assert seated["ids"] == reference(PROMPTS[0], LONG)
    assert [o.finish_reason for o in outputs if o.finished] == ["abort"]
    assert (stats.aborted, stats.finished, stats.prefills_in_verifies) == (1, 1, 1)


class LinkedProvider(RecordingProvider):
    """The recording stand-in behind a link: each verify's sequences get their next anchors prefetched."""

    link_bytes_per_s = 1e9


class AfterAVerify(Gate):
    """Holds the first drafter call made after a verify (a session with a round behind it)."""

    def __call__(self, sessions, *args):
        if sessions and sessions[0].trace and not self.go.is_set():
            self.entered.set()
            self.go.wait(20)
        return self.fn(sessions, *args)


def linked_engine(loaded, drafter, provider):
    # fixed blocks, so every round drafts on the drafter lane; last-union never runs the target
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    return AsyncEngine(spec, loaded.tokenizer, EngineConfig(speculation="fixed", drafter_lane="own"), provider=provider)


@pytest.mark.asyncio
async def test_behind_a_link_a_verify_claims_its_sequences_next_anchors_until_their_round_ran(
    loaded, drafter, reference
):
    provider = LinkedProvider()
    engine = linked_engine(loaded, drafter, provider)
    async with engine:
        pacer = engine._running.pacer
        real_claim, anchors = pacer._claim_next_anchors, []

        def claim_next_anchors(batch, outcomes):  # what the end of each verify claims
            real_claim(batch, outcomes)
            anchors.extend(s.anchor_claim for s in batch if s.anchor_claim is not None)

        pacer._claim_next_anchors = claim_next_anchors
        results = await run_all(engine, [(p, LONG) for p in PROMPTS])
        stats = await drained(engine)
    assert [ids for ids, _, _ in results] == [reference(p, LONG) for p in PROMPTS]
    assert stats.anchor_prefetches == len(anchors) > 0
    # each anchor claim is passed by exactly one verify's forward (its round's), then released
    forwarded = [claim for claims in provider.forwarded for claim in claims]
    assert all(forwarded.count(claim) == 1 for claim in anchors)
    assert stats.claimed_experts == 0 and not provider.claims


@pytest.mark.asyncio
async def test_behind_a_link_a_plain_round_after_a_verify_asks_no_lane(loaded, reference):
    """Each verify projects its sequences' next anchors, and a plain round takes that projection
    (Speculator.plain_round): only a sequence's first round, after its prefill, calls a lane."""
    spec = Speculator(loaded.model, None, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    engine = AsyncEngine(spec, loaded.tokenizer, EngineConfig(), provider=LinkedProvider())
    async with engine:
        real, drafted = engine.speculator.draft_rounds, []

        def draft_rounds(sessions, *args):
            drafted.extend(sessions)
            return real(sessions, *args)

        engine.speculator.draft_rounds = draft_rounds
        results = await run_all(engine, [(p, LONG) for p in PROMPTS])
        stats = await drained(engine)
    assert [ids for ids, _, _ in results] == [reference(p, LONG) for p in PROMPTS]
    assert len(drafted) == len(PROMPTS) and len({id(s) for s in drafted}) == len(PROMPTS)
    assert stats.verify_rounds > 2 * len(PROMPTS)  # the other rounds went straight to their verifies


@pytest.mark.asyncio
async def test_an_abort_while_drafting_releases_the_next_anchor_s_claim(loaded, drafter, reference):
    provider = LinkedProvider()
    engine = linked_engine(loaded, drafter, provider)
    async with engine:
        gate = engine.speculator.draft_rounds = AfterAVerify(engine.speculator.draft_rounds)
        doomed = engine.generate(PROMPTS[1], LONG, request_id="doomed")
        await anyio.to_thread.run_sync(gate.entered.wait, 20)
        held = engine._seqs["doomed"].anchor_claim
        assert held is not None and held in provider.claims
        await engine.abort("doomed")
        gate.go.set()
        _, _, last = await collect(doomed)
        kept, _, _ = await collect(engine.generate(PROMPTS[0], GREEDY))
        stats = await drained(engine)
    assert last.finish_reason == "abort" and kept == reference(PROMPTS[0])
    assert held not in provider.claims and stats.claimed_experts == 0 and not provider.claims
