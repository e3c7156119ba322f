"""The prefetch lane: one dedicated thread that runs expert fetches in priority order.

Owns the thread, its priority queue (on-demand > route-ahead > background, first come
first served within a priority) and, on CUDA, the lane's own copy stream, entered inside
every job. What a fetch does, and what its failure means, belongs to the submitter: a job
reports its own errors; one that raises anyway is logged and the lane keeps running.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import attrs
import torch

from pdflash.measure import BusyClock


class Priority(enum.IntEnum):
    ON_DEMAND = 0  # a miss inside a running forward
    ROUTE_AHEAD = 1  # the projected union of an upcoming verify
    BACKGROUND = 2  # activation-history prediction


@attrs.frozen(kw_only=True, order=True)
class LaneJob:
    priority: Priority
    sequence: int  # submission order, breaks ties within a priority
    run: Callable[[], None] = attrs.field(order=False)


class PrefetchLane:
    """Runs submitted jobs one at a time on its own thread, most urgent first."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: list[LaneJob] = []
        self._sequence = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._running = False
        self.intervals: deque[tuple[float, float]] = deque(maxlen=4096)  # (start, end) of jobs, perf_counter s
        self.busy: BusyClock | None = None  # a clock its jobs also run on (the engine's forwards-or-copies clock)
        self._thread = threading.Thread(target=self._loop, name="pdflash-prefetch", daemon=True)
        self._thread.start()

    def submit(self, priority: Priority, run: Callable[[], None]) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError("the prefetch lane is closed; create a new provider to fetch experts")
            heapq.heappush(self._queue, LaneJob(priority=priority, sequence=next(self._sequence), run=run))
            self._ready.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; False if `timeout` seconds passed first."""
        with self._ready:
            return self._ready.wait_for(lambda: not self._queue and not self._running, timeout)

    def close(self) -> None:
        """Drop queued jobs, finish the running one, stop the thread."""
        with self._ready:
            self._closed = True
            self._queue.clear()
            self._ready.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        torch.set_num_threads(1)  # copies only: no OpenMP team competing with the model lanes
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                job = heapq.heappop(self._queue)
                self._running = True
            started = time.perf_counter()
            busy = self.busy
            if busy is not None:
                busy.enter(started)
            try:
                if self.stream is None:
                    job.run()
                else:
                    with torch.cuda.stream(self.stream):
                        job.run()
            except Exception:
                logging.getLogger(__name__).exception("a prefetch lane job raised instead of reporting its error")
            ended = time.perf_counter()
            if busy is not None:
                busy.leave(ended)
            self.intervals.append((started, ended))
            with self._ready:
                self._running = False
                self._ready.notify_all()
