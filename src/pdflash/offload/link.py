"""The host-to-device link as the prefetch lane sees it: real, absent, or emulated.

Owns the link label every offload figure carries, the emulated transfer time and a real
link's rate, measured once when the cache is built (the speculation policy and the pacer
weigh bytes by it; `measure_bytes_per_s`). The emulated link is one serial pipe: a fetch
requested at time r starts when the pipe is free (or at r, if later) and takes bytes /
bandwidth + latency; the lane thread sleeps until that virtual completion. Pacing by completion times, not by summing sleeps, keeps each sleep's
overshoot from accumulating over a burst of queued fetches. Knows nothing of caches or tensors:
the cache hands the measurement its copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import attrs
import torch


@attrs.define(eq=False)
class Link:
    """How long fetches take on top of the copies themselves, and what to call the link."""

    label: str  # "none" (the device tier is host memory), "device" (real copies to an accelerator), "emulated"
    gbps: float | None = None  # emulated bandwidth in GB/s (1e9 bytes per second)
    latency_s: float = 0.0  # emulated fixed cost per fetch, seconds
    free_at: float = 0.0  # perf_counter time the emulated pipe finishes its last fetch
    measured_bytes_per_s: float | None = None  # a real link's rate, measured at start (None: unknown)

    @property
    def bytes_per_s(self) -> float | None:
        """The rate copies are priced at: the emulated bandwidth, a real link's measured one, or
        None (no link: the device tier is host memory, or a real link not measured)."""
        return self.gbps * 1e9 if self.gbps is not None else self.measured_bytes_per_s

    @classmethod
    def for_device(cls, device: torch.device, *, gbps: float | None, latency_s: float) -> Link:
        """An emulated link when `gbps` is given, else the real one of `device`."""
        if latency_s < 0:
            raise ValueError(f"link_latency_s must be >= 0, got {latency_s}")
        if gbps is None:
            if latency_s:
                raise ValueError(f"link_latency_s={latency_s} needs link_gbps (the emulated bandwidth) as well")
            return cls(label="device" if device.type == "cuda" else "none")
        if not gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (GB/s of the emulated link), got {gbps}")
        return cls(label="emulated", gbps=float(gbps), latency_s=float(latency_s))

    def transfer_s(self, nbytes: int) -> float:
        if self.gbps is None:  # the real link: copies take the time they take
            return 0.0
        return nbytes / (self.gbps * 1e9) + self.latency_s

    def transfer(self, nbytes: int, *, requested_at: float) -> None:
        """Sleep (on the lane thread) until the emulated pipe has carried `nbytes` requested at `requested_at`."""
        if self.label != "emulated":
            return
        self.free_at = max(self.free_at, requested_at) + self.transfer_s(nbytes)
        wait = self.free_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def measure_bytes_per_s(
    copies: Sequence[Callable[[], object]], nbytes: Sequence[int], synchronize: Callable[[], object]
) -> float | None:
    """Bytes per second of `copies` (copy i moves nbytes[i]), timed from one `synchronize` to the
    next after all of them are queued; the first copy is a warm-up and not counted. None when
    there is nothing to time or a copy raises (logged): prices then stay unknown, as before."""
    if len(copies) < 2 or len(copies) != len(nbytes):
        return None
    try:
        copies[0]()
        synchronize()
        started = time.perf_counter()
        for copy in copies[1:]:
            copy()
        synchronize()
        elapsed = time.perf_counter() - started
    except Exception as exc:  # a failed measurement only leaves the rate unknown
        logging.getLogger(__name__).warning("measuring the host-to-device link failed: %r", exc)
        return None
    return sum(nbytes[1:]) / elapsed if elapsed > 0 else None
