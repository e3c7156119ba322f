"""In what order a tick offers waiting verifies to the pure admission: the ordering policy.

Owns the order only (as SGLang keeps its SchedulePolicy apart from its PrefillAdder); the
budgets and the starvation guard stay in pdflash.engine.admission. "arrival" is first come,
first served. "yield" offers first every demand the guard already protects (skipped
`barrier_after` ticks or more, in arrival order, so the guard's bound still holds), then the
rest by expected committed tokens per byte they would add to what is resident or coming,
best first (ties in arrival order): when bytes are scarce, the verifies that buy the most
tokens per byte go first. The look-ahead is bounded: only the `LOOK_AHEAD` oldest of the rest
are ordered by yield, those behind them follow in arrival order. At the engine's default of
64 live sequences at most, every waiting verify is ranked; past that the bytes-alone pass over
every waiting union, the tick's largest cost, stays that of 64 (bench_admission.py).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

ORDERS = ("arrival", "yield")
LOOK_AHEAD = 64  # unguarded demands the yield order ranks, oldest first; the rest keep arrival order


@attrs.frozen(kw_only=True)
class OrderKey:
    seq_id: Hashable
    expected_tokens: float  # E[tokens committed by its verify]
    alone_bytes: int  # bytes its union adds to resident ∪ in flight (as if it were admitted alone)
    skipped_ticks: int  # ticks that passed it over


def offer_order(keys: Sequence[OrderKey], order: str, barrier_after: int) -> list[int]:
    """Indices into `keys` (given in arrival order) in the order a tick offers them."""
    columns = ([k.expected_tokens for k in keys], [k.alone_bytes for k in keys], [k.skipped_ticks for k in keys])
    return offer_order_columns(*columns, order, barrier_after).tolist()


def offer_order_columns(
    expected_tokens: npt.ArrayLike,
    alone_bytes: npt.ArrayLike,
    skipped_ticks: npt.ArrayLike,
    order: str,
    barrier_after: int,
) -> npt.NDArray[np.intp]:
    """`offer_order` over the keys given as columns ([n] each; what a tick calls: no key objects)."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(map(repr, ORDERS))}")
    skipped = np.asarray(skipped_ticks, dtype=np.int64)
    if order == "arrival":
        return np.arange(len(skipped), dtype=np.intp)
    guarded = skipped >= barrier_after
    rest = np.flatnonzero(~guarded)
    ranked, behind = rest[:LOOK_AHEAD], rest[LOOK_AHEAD:]
    ranked = ranked[by_yield(np.asarray(expected_tokens)[ranked].tolist(), np.asarray(alone_bytes)[ranked].tolist())]
    return np.concatenate([np.flatnonzero(guarded), ranked, behind])


def by_yield(expected_tokens: Sequence[float], alone_bytes: Sequence[int]) -> list[int]:
    """Indices of the keys ([n] columns, in arrival order, none guarded) by expected tokens per
    byte, best first, ties in arrival order: the yield order of a line the guard does not lead
    (what a tick calls on the waiting demands after the guarded ones). Plain Python: a tick runs
    after a forward, with cold caches, where numpy's divide and argsort over 64 keys cost 50 µs."""
    per_byte = [e / a if a else math.inf for e, a in zip(expected_tokens, alone_bytes, strict=True)]
    return sorted(range(len(per_byte)), key=per_byte.__getitem__, reverse=True)  # stable: ties in arrival order
