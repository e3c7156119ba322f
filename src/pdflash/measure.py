"""Small measurement formulas shared by every report: decode rate, nearest-rank percentiles,
overlap of two timelines and the busy time of several (`BusyClock`).

Owns the arithmetic only; callers own their clocks and samples.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


def tokens_per_second(tokens: int, first_token_s: float, last_token_s: float) -> float:
    """Decode rate after the first token: (tokens - 1) / (last - first); 0 when undefined."""
    span = last_token_s - first_token_s
    return (tokens - 1) / span if tokens > 1 and span > 0 else 0.0


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    permille = round(q * 1000)
    rank = max(1, (permille * len(sorted_values) + 999) // 1000)  # ceil(q * n), exact
    return sorted_values[rank - 1]


def overlap_s(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Seconds two serial timelines were busy at once: each a time-ordered run of disjoint (start, end)."""
    xs, ys = list(a), list(b)
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, end - start)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


class BusyClock:
    """Seconds during which at least one of several activities ran: the length of the union of
    their busy intervals, kept as they run (threads call `enter` / `leave` with their own clock
    readings), so no interval log is needed however long the run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0  # activities running now
        self._since = 0.0  # seconds: when the current busy stretch began
        self._busy_s = 0.0  # seconds: closed busy stretches

    def enter(self, now_s: float) -> None:
        with self._lock:
            if self._active == 0:
                self._since = now_s
            self._active += 1

    def leave(self, now_s: float) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += now_s - self._since

    def busy_s(self, now_s: float) -> float:
        """Busy seconds up to `now_s` (an open stretch counted up to it)."""
        with self._lock:
            return self._busy_s + (now_s - self._since if self._active else 0.0)
