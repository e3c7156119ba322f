"""The async engine: concurrent output equals each request alone, aborts and failures release
everything and touch nobody else, 2-D admission completes on the carried deficit, bad
configuration and requests fail before anything runs, streams never block the loop."""

from __future__ import annotations

import contextlib
import gc
import threading

import anyio
import pytest
from engine_cases import collect, drained, run_all
from transitions import MachineError

from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.charging import largest_block_union_bytes
from pdflash.engine.config import EngineConfig
from pdflash.engine.outputs import TextStream
from pdflash.engine.sequence import LIFECYCLE, Sequence, SequenceState
from pdflash.errors import EngineClosedError, EngineOverloadedError
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.projection import Projection
from pdflash.spec.projection.passes import RouterPassProjector
from pdflash.spec.speculator import Speculator
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 63)), [7], list(range(100, 111)), [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def loaded(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="module")
def drafter(loaded, drafter_dir):
    return load_drafter(drafter_dir, loaded.model)


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy autoregressive output of one prompt alone: the oracle."""
    cache = {}

    def ids(prompt, params=GREEDY):
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = list(generate_autoregressive(loaded.model, list(prompt), params).token_ids)
        return cache[key]

    return ids


@pytest.fixture
def make_engine(loaded, drafter):
    def make(spec=True, provider=None, **config):
        speculator = Speculator(loaded.model, drafter if spec else None, expert_nbytes=loaded.expert_nbytes)
        return AsyncEngine(speculator, loaded.tokenizer, EngineConfig(**config), provider=provider)

    return make


class Claim:
    def __init__(self, keys):
        self.keys = tuple(keys)


class RecordingProvider:
    """An expert provider stand-in: nothing resident, a cache of every expert, no link; prefetches
    and their claims recorded."""

    budget_bytes = 10**12
    link_bytes_per_s = None
    exposed_fetch_s = 0.0  # nothing to wait for

    def __init__(self):
        self.prefetched, self.claims, self.made, self.forwarded = [], set(), [], []

    def prefetch_launch(self, unions):
        claims = []
        for union in unions:
            self.prefetched.append(union)
            claim = Claim(union)
            self.claims.add(claim)
            self.made.append(claim)
            claims.append(claim)
        return claims

    def release(self, claim):
        self.claims.discard(claim)

    @contextlib.contextmanager
    def forward_of(self, claims):  # the claims of the batched verify running inside
        self.forwarded.append(tuple(claims))
        yield

    def resident(self):
        return frozenset()

    def copy_intervals(self):
        return []

    def watch_busy(self, clock):  # it copies nothing
        pass

    def stats(self):
        return {"prefetches": len(self.prefetched), "claims": len(self.claims)}


# --- output equals each request alone ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("drafter_lane", ["auto", "shared"])
async def test_32_concurrent_greedy_requests_equal_each_alone(make_engine, loaded, reference, drafter_lane):
    requests = [(PROMPTS[i % len(PROMPTS)] + [i], SamplingParams(max_tokens=8 + i % 9)) for i in range(32)]
    async with make_engine(drafter_lane=drafter_lane) as engine:
        results = await run_all(engine, requests)
        stats = await drained(engine)
    for (prompt, params), (ids, text, last) in zip(requests, results):
        assert ids == reference(prompt, params)
        assert text == loaded.tokenizer.decode(ids)
        m = last.metrics
        assert last.finished and last.finish_reason == "length"
        assert (m.prompt_tokens, m.generated_tokens) == (len(prompt), len(ids))
        assert sum(m.acceptance_lengths) == len(ids) - 1  # the prefill's token plus every round's
        assert m.ttft_s > 0 and m.expert_bytes > 0
    assert stats.finished == 32 and stats.failed == stats.aborted == 0
    assert max(stats.verify_batch_sizes) > 1, "verifies of concurrent sequences are batched"


@pytest.mark.asyncio
async def test_without_a_drafter_the_same_machine_decodes_blocks_of_one(make_engine, reference):
    async with make_engine(spec=False) as engine:
        results = await run_all(engine, [(p, GREEDY) for p in PROMPTS])
    for prompt, (ids, _, last) in zip(PROMPTS, results):
        assert ids == reference(prompt)
        assert set(last.metrics.acceptance_lengths) == {1}


@pytest.mark.asyncio
async def test_from_pretrained_streams_text_deltas(tiny_target, drafter_dir, loaded, reference):
    async with AsyncEngine.from_pretrained(tiny_target, drafter_dir, block_size=4, max_num_seqs=4) as engine:
        ids, text, last = await collect(engine.generate("def fib(n):", GREEDY, request_id="fib"))
    prompt = loaded.tokenizer.encode("def fib(n):")
    assert ids == reference(prompt) and text == loaded.tokenizer.decode(ids)
    assert last.request_id == "fib" and last.metrics.prompt_tokens == len(prompt)


@pytest.mark.asyncio
async def test_offloaded_experts_with_route_ahead_prefetch_keep_the_output(tiny_target, drafter_dir, reference):
    pytest.importorskip("pdflash.offload")
    offload = {"expert_cache_fraction": 0.25, "link_gbps": 16.0}
    async with AsyncEngine.from_pretrained(tiny_target, drafter_dir, offload=offload) as engine:
        results = await run_all(engine, [(p, GREEDY) for p in PROMPTS])
        stats = await drained(engine)
    assert [ids for ids, _, _ in results] == [reference(p) for p in PROMPTS]
    assert stats.prefetch_requests > 0 and stats.prefetch_errors == 0
    assert stats.provider["link"] == "emulated" and stats.provider["expert_bytes_fetched"] > 0


class ScoredProjector:
    """The router pass, with probabilities a route head would attach: its union's members certain
    but the first at 0.5, and one expert outside it at 0.3."""

    name = "scored"
    target_free = False

    def project(self, speculator, sessions, blocks):
        layers = speculator.target.config.moe_layer_ids
        projections = []
        for projection in RouterPassProjector().project(speculator, sessions, blocks):
            members = sorted(projection.union)
            outside = next((layer, e) for layer in layers for e in range(8) if (layer, e) not in projection.union)
            chances = dict.fromkeys(members, 1.0) | {members[0]: 0.5, outside: 0.3}
            projections.append(Projection(projection.union, chances))
        return projections


class SlowLink(RecordingProvider):
    """Nothing resident and a link so slow that every fetched byte outweighs any compute."""

    link_bytes_per_s = 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize("provider", [SlowLink, RecordingProvider])
async def test_a_launch_prefetches_what_it_will_likely_route_as_the_link_binds(loaded, drafter, reference, provider):
    provider = provider()
    speculator = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector=ScoredProjector())
    drafts = []
    draft_rounds = speculator.draft_rounds

    def recorded(sessions, sizes=None, drafted=None, cuts=None):
        drafts.extend(result for result in draft_rounds(sessions, sizes, drafted, cuts))
        return drafts[-len(sessions) :]

    speculator.draft_rounds = recorded
    async with AsyncEngine(speculator, loaded.tokenizer, EngineConfig(), provider=provider) as engine:
        ids, _, _ = await collect(engine.generate(PROMPTS[0], GREEDY))  # alone: one verify per launch
        stats = await drained(engine)
    assert ids == reference(PROMPTS[0]) and stats.claimed_experts == 0
    assert len(provider.prefetched) == len(drafts) > 1
    assert provider.forwarded == [(claim,) for claim in provider.made]  # each verify ran as its claim's forward
    # the charged union keeps the coin flip; the prefetch drops it once a verify was timed (a
    # size's first verify is a warm-up) and the fit solved, at the launch after it, which ticked
    # (prefetched) before it launched: from the third or fourth round (before, the certainty is
    # 0: the unions whole), and never without a link
    kinds = [
        "whole"
        if prefetched == draft.expert_union
        else "sure"
        if prefetched == frozenset(sorted(draft.expert_union)[1:])
        else "other"
        for draft, prefetched in zip(drafts, provider.prefetched, strict=True)
    ]
    if provider.link_bytes_per_s is None:
        assert set(kinds) == {"whole"}
    else:
        timed = kinds.index("sure")
        assert 2 <= timed <= 3 and kinds == ["whole"] * timed + ["sure"] * (len(kinds) - timed)


# --- aborts and early exits ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_abort_mid_verify_releases_everything_and_spares_the_others(make_engine, reference):
    provider = RecordingProvider()
    entered, go = threading.Event(), threading.Event()
    async with make_engine(provider=provider) as engine:
        verify = engine.speculator.verify_rounds

        def held_verify(sessions):  # the first verify waits until the test lets it go
            if not go.is_set():
                entered.set()
                go.wait(20)
            return verify(sessions)

        engine.speculator.verify_rounds = held_verify
        outputs = {}

        async def consume(rid, prompt):
            outputs[rid] = await collect(engine.generate(prompt, GREEDY, request_id=rid))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "doomed", PROMPTS[1])
            tg.start_soon(consume, "kept", PROMPTS[0])
            await anyio.to_thread.run_sync(entered.wait, 20)
            during = engine.stats()
            assert during.sequences_by_state == {"verify": 2} and during.claimed_experts > 0
            tg.start_soon(engine.abort, "doomed")
            await anyio.sleep(0.05)
            assert engine.stats().sequences_by_state == {"aborted": 1, "verify": 1}  # KV kept until the lane is done
            go.set()
        stats = await drained(engine)
    _, _, last = outputs["doomed"]
    assert last.finished and last.finish_reason == "abort"
    assert outputs["kept"][0] == reference(PROMPTS[0])
    assert (stats.aborted, stats.finished) == (1, 1) and provider.prefetched


@pytest.mark.asyncio
async def test_abort_of_a_waiting_request_and_of_an_unknown_one(make_engine):
    async with make_engine() as engine:
        stream = engine.generate(PROMPTS[0], GREEDY, request_id="w")
        assert engine.stats().waiting == 1
        assert await engine.abort("w") is True
        assert await engine.abort("w") is False and await engine.abort("nobody") is False
        _, _, last = await collect(stream)
        assert last.finish_reason == "abort"
        await drained(engine)


@pytest.mark.asyncio
async def test_consumer_that_breaks_or_is_cancelled_aborts_its_request(make_engine, reference):
    async with make_engine(provider=RecordingProvider()) as engine:
        long = SamplingParams(max_tokens=200)
        async for _ in engine.generate(PROMPTS[1], long):
            break  # the generator is closed when dropped: that aborts the request

        async def cancelled_consumer(task_status):
            async for _ in engine.generate(PROMPTS[3], long):
                task_status.started()
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            await tg.start(cancelled_consumer)
            tg.cancel_scope.cancel()
        ids, _, _ = await collect(engine.generate(PROMPTS[0], GREEDY))
        stats = await drained(engine)
    assert ids == reference(PROMPTS[0])
    assert (stats.aborted, stats.finished) == (2, 1)


@pytest.mark.asyncio
async def test_stream_dropped_before_its_first_iteration_aborts_its_request(make_engine, reference):
    async with make_engine() as engine:
        engine.generate(PROMPTS[1], SamplingParams(max_tokens=200), request_id="dropped")  # never iterated
        gc.collect()
        for _ in range(100):  # the abort is scheduled on the loop by the collector
            if "dropped" not in engine._seqs:
                break
            await anyio.sleep(0.01)
        ids, _, _ = await collect(engine.generate(PROMPTS[0], GREEDY))
        stats = await drained(engine)
    assert ids == reference(PROMPTS[0])
    assert (stats.aborted, stats.finished) == (1, 1) and stats.kv_bytes == 0


# --- failure isolation ---------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("round_name", ["draft_rounds", "verify_rounds"])
async def test_an_error_in_one_sequences_round_fails_only_that_request(make_engine, reference, round_name):
    poison = PROMPTS[2]
    async with make_engine() as engine:
        real = getattr(engine.speculator, round_name)

        def poisoned(sessions, *args):
            results = real(sessions, *args)  # the batch advances every session, then raises: retry must undo that
            if any(s.prompt_ids == poison for s in sessions):
                raise RuntimeError("injected fault")
            return results

        setattr(engine.speculator, round_name, poisoned)
        outputs = {}

        async def consume(i, prompt):
            try:
                outputs[i] = (await collect(engine.generate(prompt, GREEDY)))[0]
            except RuntimeError as error:
                outputs[i] = error

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(PROMPTS):
                tg.start_soon(consume, i, prompt)
        stats = await drained(engine)
    for i, prompt in enumerate(PROMPTS):
        if prompt == poison:
            assert isinstance(outputs[i], RuntimeError) and "injected fault" in str(outputs[i])
        else:
            assert outputs[i] == reference(prompt)
    assert (stats.failed, stats.finished) == (1, len(PROMPTS) - 1)


@pytest.mark.asyncio
async def test_a_bug_in_the_step_loop_fails_every_request_and_stops_the_engine(make_engine):
    engine = make_engine()

    def broken_admission(*args, **kwargs):
        raise RuntimeError("scheduler bug")

    engine.scheduler.tick = broken_admission
    with pytest.raises(ExceptionGroup) as raised:  # the loop's task group re-raises the bug on exit
        async with engine:
            assert engine.running and engine.error is None
            stream = engine.generate(PROMPTS[0], GREEDY)
            with pytest.raises(RuntimeError, match="scheduler bug"):
                await collect(stream)
            assert not engine.running and "scheduler bug" in repr(engine.error)
            with pytest.raises(EngineClosedError, match="step loop stopped"):
                engine.generate(PROMPTS[1], GREEDY)
    assert raised.group_contains(RuntimeError, match="scheduler bug")
    assert not engine.running


# --- verify admission ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_byte_budget_below_one_rounds_demand_completes_on_the_carried_deficit(
    make_engine, loaded, drafter, reference
):
    speculator = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes)
    block_bytes = largest_block_union_bytes(
        speculator.expert_nbytes, speculator.block_size, speculator.target.config.top_k
    )
    one_expert = max(loaded.expert_nbytes.values())
    async with make_engine(
        verify_token_budget=64, verify_byte_budget=4 * one_expert, verify_token_cap=64, verify_byte_cap=2 * block_bytes
    ) as engine:
        results = await run_all(engine, [(p, GREEDY) for p in PROMPTS])
        stats = await drained(engine)
    assert [ids for ids, _, _ in results] == [reference(p) for p in PROMPTS]
    batches = sum(stats.verify_batch_sizes.values())
    assert stats.ticks > batches, "some ticks admitted nothing and carried their quantum"
    assert stats.admission_wait_p50_s > 0


def test_budgets_that_can_never_admit_a_block_are_rejected_at_start(make_engine):
    ok = dict(verify_token_budget=8, verify_byte_budget=10**9, verify_token_cap=64, verify_byte_cap=10**9)
    with pytest.raises(ValueError, match="verify_token_cap=7 is smaller than one verify block of 8 tokens"):
        make_engine(**ok | {"verify_token_cap": 7})
    with pytest.raises(ValueError, match="verify_byte_cap=1000 is smaller than the largest expert union"):
        make_engine(**ok | {"verify_byte_cap": 1000})
    with pytest.raises(ValueError, match="all four or none"):
        make_engine(verify_token_budget=8)
    with pytest.raises(ValueError, match="verify_byte_budget=0 is invalid"):
        make_engine(**ok | {"verify_byte_budget": 0})
    with pytest.raises(ValueError, match="charge_mode='cheap' is not one of"):
        make_engine(charge_mode="cheap")
    with pytest.raises(ValueError, match="drafter_lane='both' is not one of 'auto', 'own', 'shared'"):
        make_engine(drafter_lane="both")


# --- backpressure and streams --------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_consumer_that_never_reads_does_not_slow_the_others(make_engine, reference):
    async with make_engine() as engine:
        unread = engine.generate(PROMPTS[1], SamplingParams(max_tokens=150))
        with anyio.fail_after(30):
            results = await run_all(engine, [(p, GREEDY) for p in PROMPTS])
        assert [ids for ids, _, _ in results] == [reference(p) for p in PROMPTS]
        await drained(engine, timeout=60)
        merged = await unread.__anext__()  # everything it missed, as one delta
        assert merged.finished and len(merged.token_ids) == 150


@pytest.mark.asyncio
async def test_a_full_waiting_queue_raises_overloaded(make_engine):
    async with make_engine(max_num_seqs=1, max_waiting=2) as engine:
        first = engine.generate(PROMPTS[0], GREEDY)
        second = engine.generate(PROMPTS[1], GREEDY)
        with pytest.raises(EngineOverloadedError, match=r"2 requests are already waiting \(max_waiting=2\)"):
            engine.generate(PROMPTS[2], GREEDY)
        for stream in (first, second):
            await collect(stream)
        stats = await drained(engine)
    assert stats.requests == stats.finished == 2


@pytest.mark.asyncio
async def test_invalid_requests_are_rejected_before_anything_is_queued(make_engine):
    async with make_engine() as engine:
        with pytest.raises(ValueError, match="temperature=-1 is invalid: it must be a finite number >= 0"):
            engine.generate(PROMPTS[0], {"temperature": -1})
        with pytest.raises(ValueError, match=r"unknown fields \['temprature'\]"):
            engine.generate(PROMPTS[0], {"temprature": 0.5})
        with pytest.raises(ValueError, match=r"prompt token ids \[999\] are not ints in the vocabulary 0..263"):
            engine.generate([1, 999], GREEDY)
        with pytest.raises(ValueError, match="at least one token"):
            engine.generate([], GREEDY)
        with pytest.raises(ValueError, match="context limit is 2048"):
            engine.generate([1] * 2048, GREEDY)
        with pytest.raises(TypeError, match="got str"):
            engine.generate(PROMPTS[0], "greedy")
        assert engine.stats().requests == 0 and engine.stats().waiting == 0


@pytest.mark.asyncio
async def test_stop_string_truncates_the_text_before_it(make_engine, loaded, reference):
    prompt, params = PROMPTS[1], SamplingParams(max_tokens=40)
    ids = reference(prompt, params)
    text = loaded.tokenizer.decode(ids)
    at = next(k for k in range(3, len(text) - 2) if "\ufffd" not in text[k : k + 2] and text.find(text[k : k + 2]) == k)
    stop = text[at : at + 2]
    cut = next(n for n in range(1, len(ids) + 1) if stop in loaded.tokenizer.decode(ids[:n]))
    async with make_engine() as engine:
        got_ids, got_text, last = await collect(engine.generate(prompt, SamplingParams(max_tokens=40, stop=stop)))
    assert got_text == text[:at]
    assert got_ids == ids[:cut] and last.finish_reason == "stop"


def test_text_stream_holds_back_partial_utf8_and_stop_prefixes(loaded):
    tok = loaded.tokenizer
    text = "héllo € 😀!"
    stream = TextStream(tok, ())
    deltas = []
    for token in tok.encode(text):
        stream.push(token)
        deltas.append(stream.take(final=False))
    assert "".join(deltas) + stream.take(final=True) == text
    assert all("\ufffd" not in d for d in deltas)

    stopping = TextStream(tok, ("xyz",))
    for token in tok.encode("abcx"):
        stopping.push(token)
    assert stopping.take(final=False) == "abc"  # "x" may begin "xyz"
    for token in tok.encode("yq"):
        stopping.push(token)
    assert stopping.take(final=False) == "xyq"


# --- the state machine ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_illegal_lifecycle_triggers_raise_and_exit_leaves_the_machine():
    seq = Sequence("s", (1, 2), GREEDY, TextStream(None, ()))
    assert seq.state is SequenceState.WAITING and seq in LIFECYCLE.models
    with pytest.raises(MachineError):
        seq.verified()  # not verifying
    seq.schedule()
    seq.prefilled()
    with pytest.raises(MachineError):
        seq.finish()  # a DRAFT sequence has no new tokens to finish on
    seq.drafted()
    seq.verified()
    seq.drafted()
    seq.finish()
    assert seq.state is SequenceState.FINISHED and seq not in LIFECYCLE.models
    for trigger in (seq.abort, seq.fail, seq.schedule):
        with pytest.raises(MachineError):
            trigger()
