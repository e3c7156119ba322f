"""In what order a tick offers waiting verifies to the pure admission: the ordering policy.

Owns the order only (as SGLang keeps its SchedulePolicy apart from its PrefillAdder); the
budgets and the starvation guard stay in pdflash.engine.admission. "arrival" is first come,
first served. "yield" offers first every demand the guard already protects (skipped
`barrier_after` ticks or more, in arrival order, so the guard's bound still holds), then the
rest by expected committed tokens per byte they would add to what is resident or coming,
best first (ties in arrival order): when bytes are scarce, the verifies that buy the most
tokens per byte go first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

ORDERS = ("arrival", "yield")


@attrs.frozen(kw_only=True)
class OrderKey:
    seq_id: Hashable
    expected_tokens: float  # E[tokens committed by its verify]
    alone_bytes: int  # bytes its union adds to resident ∪ in flight (as if it were admitted alone)
    skipped_ticks: int  # ticks that passed it over

    @property
    def tokens_per_byte(self) -> float:
        return self.expected_tokens / self.alone_bytes if self.alone_bytes else float("inf")


def offer_order(keys: Sequence[OrderKey], order: str, barrier_after: int) -> list[int]:
    """Indices into `keys` (given in arrival order) in the order a tick offers them."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(map(repr, ORDERS))}")
    if order == "arrival":
        return list(range(len(keys)))
    guarded = [i for i, k in enumerate(keys) if k.skipped_ticks >= barrier_after]
    rest = [i for i, k in enumerate(keys) if k.skipped_ticks < barrier_after]
    rest.sort(key=lambda i: (-keys[i].tokens_per_byte, i))
    return guarded + rest
