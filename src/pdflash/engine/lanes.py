"""Executor lanes: the dedicated threads model work runs on, never the event loop.

Owns the threads (one per lane, so work on a lane is serialized in submission order), the
CUDA stream each lane enters inside every call, and the time each lane spends in calls.
Must not decide what runs: the engine submits. Speculator sessions are not thread-safe:
the engine's step runs a session's rounds one after another, never on two lanes at once.

CPU threading: torch's OpenMP runtime (libgomp) keeps a team of worker threads for every
thread that ever ran a parallel region, and once more OpenMP threads exist than CPUs it
throttles every team's spin-waiting. So model work belongs on lanes only: loading a model on
the event loop's thread and forwarding on a lane cost 5.4 instead of 3.2 ms per AR step of
the bundled model on 2 cores. `off_thread` runs such one-off work (loading) on a thread that
ends with it, and a lane uses the torch thread count of the thread that created it (a
thread-local OpenMP setting that new threads do not inherit).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
import torch

T = TypeVar("T")


def off_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a short-lived thread (its OpenMP team ends with it); its result or exception."""
    with ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="pdflash-load",
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    ) as pool:
        return pool.submit(fn).result()


class Lane:
    """One single-thread executor; on CUDA, calls run on the lane's own stream."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"pdflash-{name}",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.busy_s = 0.0  # wall time spent inside calls
        self.calls = 0

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
        try:
            with stream:
                result = fn(*args)
            if self._stream is not None:
                self._stream.synchronize()  # results are ready when the loop sees them
            return result
        finally:
            self.busy_s += time.perf_counter() - started
            self.calls += 1

    def close(self) -> None:
        """Wait for queued calls to finish and stop the thread."""
        self._executor.shutdown(wait=True)


@attrs.define
class Lanes:
    verify: Lane  # target forwards: prefill and verify
    draft: Lane  # drafter forward + route projection; the verify lane's thread (see below)
    prefetch: Lane  # route-ahead expert copies

    @classmethod
    def create(cls, device: torch.device) -> Lanes:
        # The step drafts, then verifies, each awaited: a second model thread would sit idle
        # and the two forwards would only contend for the same cores, so draft shares it.
        verify = Lane("verify", device)
        return cls(verify=verify, draft=verify, prefetch=Lane("prefetch", device))

    @property
    def model_s(self) -> float:
        """Time spent in model forwards (prefill, draft, projection, verify)."""
        extra = self.draft.busy_s if self.draft is not self.verify else 0.0
        return self.verify.busy_s + extra

    def close(self) -> None:
        for lane in {id(lane): lane for lane in (self.verify, self.draft, self.prefetch)}.values():
            lane.close()
