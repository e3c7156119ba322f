"""An admission ticket: what a sequence's coroutine awaits until a tick admits its verify demand.

Owns the wake-up event and the cancellation rule (a waiter cancelled while waiting hands its
demand back through the scheduler's release callback, so nothing leaks). Admission itself
is the scheduler's: it only calls `_admit` and `_cancel`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import anyio
import anyio.lowlevel
import attrs


class AdmissionCancelled(Exception):
    """Raised by Ticket.wait() when the demand was cancelled before it was admitted."""


@attrs.define(eq=False)
class Ticket:
    """One registration's admission ticket; a sequence's coroutine awaits `wait()`."""

    seq_id: Hashable
    _release: Callable[[Ticket], None]  # the scheduler's cleanup for a cancelled waiter
    _event: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    _cancelled: bool = attrs.field(default=False, init=False)

    @property
    def admitted(self) -> bool:
        return self._event.is_set() and not self._cancelled

    async def wait(self) -> None:
        """Return once a tick admits the demand; raise AdmissionCancelled if it was cancelled.

        A waiter cancelled while waiting (even just after admission) hands its demand
        back, so neither its place nor an already granted share of the budget leaks.
        """
        try:
            await self._event.wait()
            await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled while being woken
        except BaseException:
            self._release(self)
            raise
        if self._cancelled:
            raise AdmissionCancelled(f"the verify demand of sequence {self.seq_id!r} was cancelled")

    def _admit(self) -> None:
        self._event.set()

    def _cancel(self) -> None:
        self._cancelled = True
        self._event.set()
