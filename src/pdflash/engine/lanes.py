"""Executor lanes: the dedicated threads model work runs on, never the event loop.

Owns the threads (one per lane, so work on a lane is serialized in submission order), the
CUDA stream each lane enters inside every call, each lane's torch thread count, the busy
intervals it records, and `BatchLane`: what is submitted while a lane is busy is gathered
and run as one batched call when it frees. Must not decide what runs: the engine submits.
A session is never on two lanes at once: its own coroutine awaits each round in turn.

CPU threading: torch's OpenMP runtime (libgomp) keeps a team of worker threads for every
thread that ever ran a parallel region, and once more OpenMP threads exist than CPUs it
throttles every team's spin-waiting. So model work belongs on lanes only: loading a model on
the event loop's thread and forwarding on a lane cost 5.4 instead of 3.2 ms per AR step of
the bundled model on 2 cores. `off_thread` runs such one-off work (loading) on a thread that
ends with it; each lane gets an explicit thread count (`lane_threads`), so that the target
and drafter lanes together never ask for more OpenMP threads than the creator had.

Whether the drafter gets a lane of its own is `drafter_has_own_lane`: its own lane lets
sequences draft while others verify, but on the CPU its thread comes out of the target's.
Resident on 2 cores that split halves every verify's threads for an overlap worth at most
the drafter's share of the work, and measured 0.67-0.83x of one shared lane at 2 threads
(docs/engine.md, "One lane or two"). Offloaded, a verify mostly waits on the link, and
drafts beside it are what fill that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import attrs
import torch

from pdflash.measure import BusyClock

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
INTERVALS = 4096  # busy intervals a lane remembers (stats and tests)


def off_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a short-lived thread (its OpenMP team ends with it); its result or exception."""
    with ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="pdflash-load",
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    ) as pool:
        return pool.submit(fn).result()


DRAFTER_LANES = ("auto", "own", "shared")
SHARED_UP_TO = 3  # CPU threads up to which a resident drafter shares the target lane ("auto")


def drafter_has_own_lane(choice: str, *, device: torch.device, offloaded: bool, threads: int) -> bool:
    """Whether the drafter runs on a lane of its own (drafts overlap verifies) or on the target's.

    "own" and "shared" force it. "auto": its own lane on an accelerator (a stream of its own,
    no thread taken), with experts offloaded (drafts fill a verify's waits on the link) or at
    one thread (its lane adds a thread rather than taking one); resident on the CPU with 2 to
    SHARED_UP_TO threads it shares the target lane, which then runs drafts and verifies with
    every thread (above that, one thread is at most a quarter of the target's: not measured).
    """
    if choice not in DRAFTER_LANES:
        raise ValueError(f"drafter_lane={choice!r} is not one of {', '.join(map(repr, DRAFTER_LANES))}")
    if choice != "auto":
        return choice == "own"
    return device.type != "cpu" or offloaded or not 2 <= threads <= SHARED_UP_TO


def lane_threads(total: int, *, drafter: bool) -> tuple[int, int]:
    """(target lane, drafter lane) torch threads out of `total`: the drafter, when it has a lane
    of its own, takes one thread (its forward is a few small layers) and the target the rest, at
    least one; without one (0) the target lane has them all."""
    if not drafter:
        return max(1, total), 0
    return max(1, total - 1), 1


class Lane:
    """One single-thread executor with its own torch thread count; on CUDA, calls run on its own stream."""

    def __init__(
        self, name: str, device: torch.device, threads: int | None = None, busy: BusyClock | None = None
    ) -> None:
        self.name = name
        self._busy = busy  # the engine's clock of time with a forward or a copy running, if any
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"pdflash-{name}",
            initializer=torch.set_num_threads,
            initargs=(self.threads,),
        )
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.busy_s = 0.0  # wall time spent inside calls
        self.calls = 0
        self.intervals: deque[tuple[float, float]] = deque(maxlen=INTERVALS)  # (start, end) perf_counter s

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream every call runs on (None off CUDA)."""
        return self._stream

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the lane and await its result (its exception is raised here)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn(*args)` without waiting for it (fire and forget: check the future)."""
        return self._executor.submit(self._call, fn, args)

    def _call(self, fn: Callable[..., Any], args: tuple) -> Any:
        # anyio/asyncio never pin a thread to a stream: enter it inside every call
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        started = time.perf_counter()
        if self._busy is not None:
            self._busy.enter(started)
        try:
            with stream:
                result = fn(*args)
            if self._stream is not None:
                self._stream.synchronize()  # results are ready when the loop sees them
            return result
        finally:
            ended = time.perf_counter()
            if self._busy is not None:
                self._busy.leave(ended)
            self.busy_s += ended - started
            self.calls += 1
            self.intervals.append((started, ended))

    def close(self) -> None:
        """Wait for queued calls to finish and stop the thread."""
        self._executor.shutdown(wait=True)


@attrs.define(eq=False)
class _Job(Generic[T]):
    item: T
    done: anyio.Event = attrs.Factory(anyio.Event)
    started: bool = False
    result: Any = None
    error: BaseException | None = None


class Ride(Generic[T, R]):
    """A batch of one BatchLane's items that another lane's call runs inside its own (a prompt's
    prefill inside a batched verify). Its items count as started: a waiter cancelled meanwhile
    waits for `finish`, which answers every item exactly once."""

    def __init__(self, jobs: list[_Job[T]]) -> None:
        self._jobs = jobs

    @property
    def items(self) -> list[T]:
        return [job.item for job in self._jobs]

    def finish(self, outcomes: Sequence[R | BaseException]) -> None:
        """Each item's result, or the exception it raised, in `items` order."""
        if len(outcomes) != len(self._jobs):
            outcomes = [RuntimeError(f"a ride of {len(self._jobs)} items got {len(outcomes)} outcomes")] * len(
                self._jobs
            )
        for job, outcome in zip(self._jobs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                job.error = outcome
            else:
                job.result = outcome
            job.done.set()

    def fail(self, error: BaseException) -> None:
        """Answer every item not yet answered with `error` (the call carrying the ride broke)."""
        for job in self._jobs:
            if not job.done.is_set():
                job.error = error
                job.done.set()


@attrs.frozen(kw_only=True)
class Isolation(Generic[T]):
    """How a failed batch is retried item by item: rewind each item to before the batch first."""

    capture: Callable[[T], Any]  # item -> its state before the batch
    restore: Callable[[T, Any], None]  # (item, that state) -> rewound


class BatchLane(Generic[T, R]):
    """Gathers items submitted while busy and runs `fn(items)` as one call on `lane` when it frees.

    The hand-out is synchronous and cancellation-safe (the ticket scheduler's pattern): a
    waiter cancelled before its batch starts takes its item back out; one cancelled while its
    batch runs waits (shielded) for the batch to end, so the caller never frees what the lane
    is still using. A batch that raises is retried item by item (after `isolation.restore`),
    so an error reaches only the items that still raise alone. While `hold()` answers True,
    queued items wait for another lane's call to take them along (`ride`); `release()` tells
    the lane to look again.
    """

    def __init__(
        self,
        lane: Lane,
        fn: Callable[[list[T]], list[R]],
        *,
        name: str,
        isolation: Isolation[T] | None = None,
        cost: Callable[[T], int] | None = None,
        max_cost: int | None = None,
        hold: Callable[[], bool] | None = None,
    ) -> None:
        self.lane, self.name = lane, name
        self._fn = fn
        self._isolation = isolation
        self._hold = hold
        self._cost, self._max_cost = cost, max_cost  # a batch's items at most (the first always fits)
        self._queue: list[_Job[T]] = []
        self._wake = anyio.Event()
        self.batches = 0
        self.rides = 0  # batches taken along by another lane's call (`ride`)
        self.busy = False  # a batch of this lane was taken and has not ended (running, or waiting for the lane)
        self.busy_s = 0.0  # seconds its calls ran on the lane's thread (not counting their wait for it)

    @property
    def working(self) -> bool:
        """A batch of this lane runs now or items wait for one."""
        return self.busy or bool(self._queue)

    async def submit(self, item: T) -> R:
        job: _Job[T] = _Job(item)
        self._queue.append(job)
        self._wake.set()
        try:
            await job.done.wait()
        except BaseException:
            if not job.started:
                self._queue.remove(job)
            else:
                with anyio.CancelScope(shield=True):
                    await job.done.wait()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def release(self) -> None:
        """What `hold` answers may have changed: the lane's loop asks again."""
        self._wake.set()

    def ride(self) -> Ride[T, R] | None:
        """Hand the next batch (as this lane would take it) to another call, which runs it inside its
        own and answers each item through the ride; None when nothing waits."""
        if not self._queue:
            return None
        jobs = self._take()
        for job in jobs:
            job.started = True
        self.rides += 1
        return Ride(jobs)

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The lane's loop (run in the engine's task group): one batched call per wake-up."""
        task_status.started()
        while True:
            while not self._queue or (self._hold is not None and self._hold()):
                self._wake = anyio.Event()
                await self._wake.wait()
            jobs = self._take()
            for job in jobs:
                job.started = True
            self.busy = True
            try:
                with anyio.CancelScope(shield=True):  # the thread runs to the end whatever happens here
                    await self._run(jobs)
            finally:
                self.busy = False
                for job in jobs:
                    job.done.set()

    def _timed(self, items: list[T]) -> list[R]:  # on the lane's thread
        started = time.perf_counter()
        try:
            return self._fn(items)
        finally:
            self.busy_s += time.perf_counter() - started

    def _take(self) -> list[_Job[T]]:
        """The next batch: queued jobs in order while their cost fits (the first one always does)."""
        if self._cost is None or self._max_cost is None:
            jobs, self._queue = self._queue, []
            return jobs
        total, count = 0, 0
        for job in self._queue:
            total += self._cost(job.item)
            if count and total > self._max_cost:
                break
            count += 1
        jobs, self._queue = self._queue[:count], self._queue[count:]
        return jobs

    async def _run(self, jobs: list[_Job[T]]) -> None:
        items = [job.item for job in jobs]
        states = [self._isolation.capture(i) for i in items] if self._isolation and len(items) > 1 else None
        self.batches += 1
        try:
            results = await self.lane.run(self._timed, items)
        except Exception as error:
            if len(jobs) == 1:
                jobs[0].error = error
                return
            log.warning("a batched %s of %d items raised %r; retrying them one by one", self.name, len(jobs), error)
            for job, state in zip(jobs, states or [None] * len(jobs), strict=True):
                if self._isolation is not None:
                    self._isolation.restore(job.item, state)
                try:
                    job.result = (await self.lane.run(self._timed, [job.item]))[0]
                except Exception as alone:
                    job.error = alone
            return
        if len(results) != len(jobs):  # a batched call must answer every item: a bug, reported to each
            mismatch = RuntimeError(f"{self.name}: {len(jobs)} items gave {len(results)} results")
            for job in jobs:
                job.error = mismatch
            return
        for job, result in zip(jobs, results, strict=True):
            job.result = result
