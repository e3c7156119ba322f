"""The simulator's virtual clock and lanes: callbacks in time order, serial lanes running timed jobs.

Owns the discrete-event machinery the simulated engine runs on: a `Clock` that runs callbacks
in (time, scheduling order) order; a `SimLane`, one serial resource like an engine lane's
thread (jobs in submission order, each a generator that yields the virtual times it waits
until and returns its result); and a `SimBatchLane`, which gathers what is submitted at the
same instant, or while its call is queued or running, into its next call, as
pdflash.engine.lanes.BatchLane does (holding them, while told to, for another call to take along).
Must not know what the jobs are: the simulator (pdflash.bench.simulator) writes them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Job = Generator[float, None, Any]  # yields absolute virtual times to resume at; returns its result


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time_s: float, fn: Callable[[], None]) -> None:
        """Run `fn` at `time_s` (not before now), after everything already due then."""
        if time_s < self.now:
            raise ValueError(f"an event at {time_s} s is in the past (now {self.now} s)")
        heapq.heappush(self._heap, (time_s, next(self._order), fn))

    def run(self) -> None:
        """Run every event, in time order, until none is left."""
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


class SimLane:
    """One serial resource: jobs run one at a time, in submission order."""

    def __init__(self, clock: Clock, name: str) -> None:
        self.clock, self.name = clock, name
        self.busy_s = 0.0  # virtual seconds spent running jobs
        self.intervals: list[tuple[float, float]] = []  # (start, end) of every job
        self._queue: deque[tuple[Callable[[], Job], Callable[[Any], None]]] = deque()
        self._busy = False

    def submit(self, job: Callable[[], Job], done: Callable[[Any], None]) -> None:
        """Queue `job()`; `done(result)` runs when it returns (after the lane's next job started)."""
        self._queue.append((job, done))
        if not self._busy:
            self._start()

    def _start(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        job, done = self._queue.popleft()
        self._step(job(), done, self.clock.now)

    def _step(self, gen: Job, done: Callable[[Any], None], started: float) -> None:
        try:
            resume = next(gen)
        except StopIteration as finished:
            self.busy_s += self.clock.now - started
            self.intervals.append((started, self.clock.now))
            self._start()  # the lane's thread takes its next call at once; waiters hear back after
            done(finished.value)
            return
        self.clock.at(resume, lambda: self._step(gen, done, started))


class SimBatchLane(Generic[T]):
    """Items submitted while this lane's call is queued or running go into its next call."""

    def __init__(
        self,
        lane: SimLane,
        run: Callable[[list[T]], Job],
        deliver: Callable[[list[T], Any], None],
        *,
        cost: Callable[[T], int] | None = None,
        max_cost: int | None = None,
        hold: Callable[[], bool] | None = None,
    ) -> None:
        self.lane, self._run, self._deliver = lane, run, deliver
        self._cost, self._max_cost = cost, max_cost  # a call's items at most (the first always fits)
        self._hold = hold  # while True, queued items wait for another call to take them (`ride`)
        self._queue: list[T] = []
        self._busy = False
        self.batches = 0
        self.rides = 0

    def submit(self, item: T) -> None:
        """Queue `item`; an idle lane calls at the end of this instant, so what the same instant
        submits batches together (the engine's lane loop wakes after the submitters ran)."""
        self._queue.append(item)
        self.release()

    def release(self) -> None:
        """What `hold` answers may have changed: an idle lane with items queued calls this instant."""
        if self._queue and not self._busy and not self._held():
            self._busy = True
            self.lane.clock.at(self.lane.clock.now, self._call)

    def ride(self) -> list[T]:
        """The next batch, for another call to run inside its own (its caller delivers it)."""
        if not self._queue:
            return []
        self.rides += 1
        return self._take()

    def _held(self) -> bool:
        return self._hold is not None and self._hold()

    def _call(self) -> None:
        if self._held() or not self._queue:  # held since the call was due, or its items rode
            self._busy = False
            return
        items = self._take()
        self._busy, self.batches = True, self.batches + 1
        self.lane.submit(lambda: self._run(items), lambda result: self._done(items, result))

    def _take(self) -> list[T]:
        if self._cost is None or self._max_cost is None:
            items, self._queue = self._queue, []
            return items
        total, count = 0, 0
        for item in self._queue:
            total += self._cost(item)
            if count and total > self._max_cost:
                break
            count += 1
        items, self._queue = self._queue[:count], self._queue[count:]
        return items

    def _done(self, items: list[T], result: Any) -> None:
        self._busy = False
        if self._queue and not self._held():  # the lane's loop takes what queued meanwhile before its waiters run
            self._call()
        self._deliver(items, result)
