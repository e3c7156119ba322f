"""The async engine: takes requests, steps every live sequence through its rounds, streams outputs.

Owns the step loop (schedule -> run -> postprocess), backpressure, failure isolation,
the request API and engine stats. Must not touch: admission arithmetic (pdflash.engine.
admission, .charging, .scheduler), round algorithms (pdflash.spec), model math, or the
expert cache; an optional expert provider is only asked to prefetch, to say what is
resident, and for its stats. Model assembly lives in pdflash.engine.builder.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from pdflash.engine.builder import OffloadProvider, build_engine_parts
from pdflash.engine.config import EngineConfig, EngineStats
from pdflash.engine.lanes import Lane
from pdflash.engine.outputs import RequestOutput, TextStream
from pdflash.engine.requests import prompt_token_ids
from pdflash.engine.requests import sampling_params as request_sampling_params
from pdflash.engine.sequence import Sequence, SequenceState
from pdflash.errors import EngineClosedError, EngineOverloadedError
from pdflash.sampling import SamplingParams
from pdflash.spec.speculator import Speculator
from pdflash.stopping import StopRule
from pdflash.target.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
S = SequenceState


@attrs.define
class _Totals:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    verify_rounds: int = 0
    verify_tokens: int = 0
    steps: int = 0
    prefetch_requests: int = 0
    prefetch_errors: int = 0
    verify_batches: Counter = attrs.Factory(Counter)


class AsyncEngine:
    """Serves many concurrent requests over one Speculator. Use as `async with engine:`."""

    def __init__(
        self,
        speculator: Speculator,
        tokenizer: TextTokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        provider: OffloadProvider | None = None,
    ) -> None:
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.config = config if config is not None else EngineConfig()
        self.provider = provider
        self.scheduler = self.config.verify_scheduler(
            speculator.block_size, speculator.expert_nbytes, speculator.target.config.top_k
        )
        self._seqs: dict[str, Sequence] = {}  # every sequence not yet released, in arrival order
        self._waiting: deque[Sequence] = deque()
        self._totals = _Totals()
        self._ids = itertools.count()
        self._lane: Lane | None = None  # target and drafter forwards (one thread; its own CUDA stream)
        self._task_group: anyio.abc.TaskGroup | None = None
        self._wakeup: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the step loop's, for aborts from the collector
        self._owned: list[Any] = []  # closed on exit (a provider from_pretrained built)
        self.error: Exception | None = None  # what stopped the step loop, if a bug did

    @classmethod
    def from_pretrained(
        cls,
        target: Path | str | None = None,
        drafter: Path | str | None = None,
        *,
        block_size: int | None = None,
        projector: str | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        offload: Mapping[str, Any] | None = None,
        progress: bool = False,
        **config: Any,
    ) -> AsyncEngine:
        """Load a target and optionally a DFlash drafter (no target: the bundled pair).

        `offload`: keywords of `pdflash.offload.load_offloaded_target` (expert_cache_fraction,
        link_gbps, ...) to serve experts from the host store; its provider is closed on exit.
        `config`: EngineConfig fields. See `pdflash.engine.builder.build_engine_parts`.
        """
        engine_config = EngineConfig(**config)
        parts = build_engine_parts(
            target,
            drafter,
            block_size=block_size,
            projector=projector,
            dtype=dtype,
            device=device,
            offload=offload,
            progress=progress,
            byte_budgets=engine_config.two_dimensional,
        )
        try:
            engine = cls(parts.speculator, parts.tokenizer, engine_config, provider=parts.provider)
        except BaseException:
            if parts.provider is not None:
                parts.provider.close()
            raise
        if parts.provider is not None:
            engine._owned.append(parts.provider)
        return engine

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        if self._lane is not None:
            raise EngineClosedError("an engine runs once: create a new one instead of re-entering it")
        self._lane = Lane("model", self.speculator.target.device)
        self._loop = asyncio.get_running_loop()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self._run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        task_group, lane = self._task_group, self._lane
        if task_group is None or lane is None:
            return None
        for seq in [s for s in self._seqs.values() if s.live]:
            self._abort(seq)
        task_group.cancel_scope.cancel()
        # the body's own error propagates as itself, not wrapped in the loop's ExceptionGroup
        body_error = exc_info[1] is not None and not isinstance(exc_info[1], anyio.get_cancelled_exc_class())
        try:
            suppress = await task_group.__aexit__(*((None, None, None) if body_error else exc_info))
            return None if body_error else suppress
        finally:
            self._task_group = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lane.close)  # a running forward finishes first
            for seq in list(self._seqs.values()):
                seq.busy = False
                self._release(seq)
            for owned in self._owned:
                owned.close()

    # -- the request API ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of output deltas.

        Everything is validated before the request is queued (ValueError; TypeError for a
        wrong type). Breaking out of the iteration, cancelling the consumer or dropping the
        stream (even un-started, once it is garbage collected) aborts it.
        """
        if self.error is not None:
            raise EngineClosedError(f"the engine's step loop stopped: {self.error!r}") from self.error
        if self._task_group is None:
            raise EngineClosedError("the engine is not running; use it inside `async with engine:`")
        params = request_sampling_params(sampling_params)
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.speculator.target.config.vocab_size)
        cfg = self.speculator.target.config
        StopRule.for_request(len(prompt_ids), params, cfg.max_positions)  # context limit
        text = TextStream(self.tokenizer, params.stop)
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if len(self._waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{len(self._waiting)} requests are already waiting (max_waiting={self.config.max_waiting}); "
                "retry later or raise max_waiting"
            )
        seq = Sequence(request_id, tuple(prompt_ids), params, text)
        self._seqs[request_id] = seq
        self._waiting.append(seq)
        self._totals.requests += 1
        self._wake()
        stream = self._stream(seq)
        # an async generator dropped before its first step never runs its `finally`
        weakref.finalize(stream, self._stream_collected, seq)
        return stream

    def _stream_collected(self, seq: Sequence) -> None:
        """Runs inside the garbage collector, maybe mid-step: the abort waits for the loop."""
        if seq.live and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_if_live, seq)

    def _abort_if_live(self, seq: Sequence) -> None:
        if seq.live:
            self._abort(seq)

    async def _stream(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        # No task group or cancel scope around the yield: the mailbox is awaited plainly.
        try:
            while True:
                output = await seq.mailbox.get()
                yield output
                if output.finished:
                    return
        finally:
            if seq.live:  # the consumer left early (break, cancellation, close)
                self._abort(seq)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request and wait until its KV, demand and pins are released."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.live:
            return False
        self._abort(seq)
        await seq.released.wait()
        return True

    @property
    def running(self) -> bool:
        """Inside `async with` and the step loop has not died."""
        return self._task_group is not None and self.error is None

    def stats(self) -> EngineStats:
        t = self._totals
        sched = self.scheduler.stats()
        return EngineStats(
            live_sequences=len(self._seqs) - len(self._waiting),
            sequences_by_state=dict(Counter(s.state.value for s in self._seqs.values())),
            waiting=len(self._waiting),
            pending_demands=sched.pending + sched.in_flight,
            kv_bytes=sum(s.kv_bytes for s in self._seqs.values()),
            claimed_experts=len(frozenset().union(*(s.claimed for s in self._seqs.values()))),
            requests=t.requests,
            finished=t.finished,
            aborted=t.aborted,
            failed=t.failed,
            generated_tokens=t.tokens,
            verify_rounds=t.verify_rounds,
            steps=t.steps,
            mean_acceptance_length=t.verify_tokens / t.verify_rounds if t.verify_rounds else 0.0,
            verify_batch_sizes=dict(sorted(t.verify_batches.items())),
            admission_wait_p50_s=sched.wait_p50_s,
            admission_wait_p99_s=sched.wait_p99_s,
            model_s=self._lane.busy_s if self._lane is not None else 0.0,
            prefetch_requests=t.prefetch_requests,
            prefetch_errors=t.prefetch_errors,
            provider=self.provider.stats() if self.provider is not None else None,
        )

    # -- the step loop -----------------------------------------------------------------------

    async def _run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                if not self._has_work():
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                await self._step()
                await anyio.lowlevel.checkpoint()
        except Exception as error:  # a bug outside any one sequence: every request learns of it
            self.error = error
            for seq in [s for s in self._seqs.values() if s.live]:
                self._fail(seq, error)
            raise

    async def _step(self) -> None:
        """One step: prefill newcomers, draft every DRAFT sequence, admit, prefetch, verify, stream."""
        self._totals.steps += 1
        await self._prefill(self._schedule_prefills())
        await self._draft([s for s in self._seqs.values() if s.state is S.DRAFT])
        admitted = self._admit_verifies()
        self._prefetch(admitted)
        await self._verify(admitted)

    def _schedule_prefills(self) -> list[Sequence]:
        """Waiting requests in arrival order while live seats and the prefill token budget allow."""
        batch: list[Sequence] = []
        tokens = 0
        room = self.config.max_num_seqs - (len(self._seqs) - len(self._waiting))
        while self._waiting and len(batch) < room:
            prompt_tokens = len(self._waiting[0].prompt_ids)
            if batch and tokens + prompt_tokens > self.config.prefill_token_budget:
                break
            seq = self._waiting.popleft()
            seq.schedule()
            batch.append(seq)
            tokens += prompt_tokens
        return batch

    async def _prefill(self, batch: list[Sequence]) -> None:
        if not batch:
            return
        done = await self._on_lane(self._begin_sessions, batch, lambda s: s, snapshot=False)
        for seq, session in done:
            seq.session = session
        self._settle(batch)
        for seq, session in done:
            if seq.live:
                with self._isolated(seq):
                    self._advance(seq, session.emitted, session.finish_reason, seq.prefilled)

    def _begin_sessions(self, batch: list[Sequence]) -> list[Any]:  # on the lane
        return self.speculator.begin_sessions([(s.prompt_ids, s.params) for s in batch], [s.text for s in batch])

    async def _draft(self, batch: list[Sequence]) -> None:
        if not batch:
            return
        done = await self._on_lane(self.speculator.draft_rounds, batch, lambda s: s.session)
        self._settle(batch)
        now = time.perf_counter()
        for seq, draft in done:
            if seq.live:
                with self._isolated(seq):
                    seq.ticket = self.scheduler.register(
                        seq.request_id, draft.tokens, draft.expert_union, draft.expert_bytes, draft.fetch_bytes
                    )
                    seq.draft, seq.drafted_at = draft, now
                    seq.drafted()

    def _admit_verifies(self) -> list[Sequence]:
        """One admission tick; every sequence whose ticket is admitted now verifies."""
        if self.scheduler.pending_count():
            resident = frozenset(self.provider.resident()) if self.provider is not None else frozenset()
            # in_flight_union is empty: each step awaits its verify, so no copy of an earlier
            # tick is still owed when this one charges
            self.scheduler.tick(resident, frozenset())
        now = time.perf_counter()
        admitted = [
            s for s in self._seqs.values() if s.state is S.VERIFY and s.ticket is not None and s.ticket.admitted
        ]
        for seq in admitted:
            self.scheduler.mark_in_flight(seq.request_id)
            seq.admission_wait_s += now - seq.drafted_at
        return admitted

    def _prefetch(self, admitted: list[Sequence]) -> None:
        """Route-ahead: ask the provider for the admitted unions before the verify needs them.

        The provider only queues the fetches on its own prefetch thread and claims them; it
        never blocks this loop. A failed prefetch only means on-demand fetches later.
        """
        if not admitted or self.provider is None:
            return
        for seq in admitted:
            seq.claimed = seq.draft.expert_union if seq.draft is not None else frozenset()
        self._totals.prefetch_requests += 1
        try:
            self.provider.prefetch(frozenset().union(*(s.claimed for s in admitted)))
        except Exception as error:
            self._totals.prefetch_errors += 1
            log.warning("route-ahead prefetch failed: %r", error)

    async def _verify(self, batch: list[Sequence]) -> None:
        if not batch:
            return
        self._totals.verify_batches[len(batch)] += 1
        done = await self._on_lane(self.speculator.verify_rounds, batch, lambda s: s.session)
        self._settle(batch)
        for seq, result in done:
            if seq.live:
                with self._isolated(seq):
                    self.scheduler.finish(seq.request_id)
                    seq.ticket, seq.draft, seq.claimed = None, None, frozenset()
                    trace = result.trace
                    seq.acceptance_lengths.append(trace.acceptance_length)
                    seq.expert_bytes += trace.expert_bytes
                    seq.fetch_bytes += trace.fetch_bytes
                    self._totals.verify_rounds += 1
                    self._totals.verify_tokens += trace.acceptance_length
                    self._advance(seq, result.accepted_ids, result.finish_reason, seq.verified)

    def _advance(
        self,
        seq: Sequence,
        token_ids: tuple[int, ...] | list[int],
        finish_reason: str | None,
        next_state: Callable[[], bool],
    ) -> None:
        """Stream a round's tokens, then finish the sequence or move it on."""
        seq.stream(token_ids, finish_reason)
        self._totals.tokens += len(token_ids)
        if finish_reason is None:
            next_state()
        else:
            seq.finish()
            self._totals.finished += 1
            self._retire(seq)

    # -- the lane and failure isolation ------------------------------------------------------

    async def _on_lane(
        self,
        fn: Callable[[list], list],
        batch: list[Sequence],
        arg: Callable[[Sequence], Any],
        *,
        snapshot: bool = True,
    ) -> list[tuple[Sequence, Any]]:
        """Run one batched round on the model lane; if it raises, retry each sequence alone and
        fail only those that still raise (a batch's error does not say which sequence caused it)."""
        lane = self._lane
        if lane is None:
            raise EngineClosedError("the engine is not running; use it inside `async with engine:`")
        sessions = [s.session for s in batch] if snapshot and len(batch) > 1 else []
        snapshots = [session.snapshot() for session in sessions if session is not None]
        for seq in batch:
            seq.busy = True
        try:
            return list(zip(batch, await lane.run(fn, [arg(s) for s in batch]), strict=True))
        except Exception as error:
            if len(batch) == 1:
                self._fail(batch[0], error)
                return []
            log.warning(
                "a batched %s of %d sequences raised %r; retrying them one by one",
                getattr(fn, "__name__", "round"),
                len(batch),
                error,
            )
        done = []
        for i, seq in enumerate(batch):
            if snapshots and seq.session is not None:
                seq.session.restore(snapshots[i])
            if not seq.live:
                continue
            try:
                done.append((seq, (await lane.run(fn, [arg(seq)]))[0]))
            except Exception as error:
                self._fail(seq, error)
        return done

    @contextlib.contextmanager
    def _isolated(self, seq: Sequence) -> Iterator[None]:
        """Postprocessing one sequence: an error fails that sequence only."""
        try:
            yield
        except Exception as error:
            self._fail(seq, error)

    def _settle(self, batch: list[Sequence]) -> None:
        """After a lane call: sequences that exited during it can now give back their KV."""
        for seq in batch:
            seq.busy = False
            if not seq.live:
                self._release(seq)

    # -- exits -------------------------------------------------------------------------------

    def _abort(self, seq: Sequence) -> None:
        if seq.state is S.WAITING:
            self._waiting.remove(seq)
        seq.abort()
        seq.close_stream("abort")
        self._totals.aborted += 1
        self._retire(seq)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("request %s failed in state %s: %r", seq.request_id, seq.state.value, error)
        if seq.state is S.WAITING:
            self._waiting.remove(seq)
        seq.fail()
        seq.mailbox.fail(error)
        self._totals.failed += 1
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """An exited sequence drops its demand now and its KV as soon as no lane uses it."""
        self.scheduler.cancel(seq.request_id)
        if not seq.busy:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.released.is_set():
            return
        if seq.session is not None:
            self.speculator.release(seq.session)
        seq.ticket, seq.draft, seq.claimed = None, None, frozenset()
        del self._seqs[seq.request_id]
        seq.released.set()

    # -- helpers -----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        running = len(self._seqs) - len(self._waiting)
        return (bool(self._waiting) and running < self.config.max_num_seqs) or any(
            s.state is S.DRAFT or s.state is S.VERIFY for s in self._seqs.values()
        )

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
