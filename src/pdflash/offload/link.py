"""The host-to-device link as the prefetch lane sees it: real, absent, or emulated.

Owns the link label every offload figure carries and the emulated transfer time. The
emulated link is one serial pipe: a fetch requested at time r starts when the pipe is free
(or at r, if later) and takes bytes / bandwidth + latency; the lane thread sleeps until that
virtual completion. Pacing by completion times, not by summing sleeps, keeps each sleep's
overshoot from accumulating over a burst of queued fetches. Knows nothing of caches or tensors.
"""

from __future__ import annotations

import time

import attrs
import torch


@attrs.define(eq=False)
class Link:
    """How long fetches take on top of the copies themselves, and what to call the link."""

    label: str  # "none" (the device tier is host memory), "device" (real copies to an accelerator), "emulated"
    gbps: float | None = None  # emulated bandwidth in GB/s (1e9 bytes per second)
    latency_s: float = 0.0  # emulated fixed cost per fetch, seconds
    free_at: float = 0.0  # perf_counter time the emulated pipe finishes its last fetch

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
