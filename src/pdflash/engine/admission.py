"""The pure 2-D deficit admission of pending verifies (ARCHITECTURE "2-D deficit admission").

Owns the (tokens, expert bytes) value type every budget, cap, carried deficit and pool is
written in, the one-tick admission function and its input checks, including the liveness
rule that a cap must hold the largest single demand, and its first-fit rule over a line given
as columns (`first_fit`, which the scheduler calls with inputs it checked at registration). Pure: no I/O, no mutation, no clock;
the ticket scheduler (pdflash.engine.scheduler) owns order, tickets and the carry.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, cast

import attrs
import numpy as np
import numpy.typing as npt


@attrs.frozen
class TokensBytes:
    """A (tokens, expert bytes) pair: a budget, a carried deficit, a cap, a pool or a charge."""

    tokens: int  # tokens
    expert_bytes: int  # bytes

    def clamped(self, cap: TokensBytes) -> TokensBytes:
        """Each dimension clamped to [0, cap]: what a pool may carry to the next tick."""
        return TokensBytes(min(max(self.tokens, 0), cap.tokens), min(max(self.expert_bytes, 0), cap.expert_bytes))


ZERO = TokensBytes(0, 0)


@attrs.frozen
class VerifyDemand:
    """What one pending verify asks of a tick."""

    seq_id: Hashable  # the sequence whose verify this is
    tokens: int  # tokens in the block to verify
    expert_bytes: int  # bytes charged for its projected routed union (pdflash.engine.charging)
    in_flight: bool = False  # verify running / prefetch under way: seated unconditionally
    skipped_ticks: int = 0  # ticks that passed this demand over (starvation guard input)


@attrs.frozen
class VerifyAdmission:
    """What one tick decided."""

    seated_ids: tuple  # seq_ids of in-flight demands, seated first, in input order
    admitted_ids: tuple  # seq_ids of newly admitted demands, in input order
    carried: TokensBytes  # unused quantum carried to the next tick, in [0, cap]


def admit_verify_demands(
    demands: Iterable[VerifyDemand],
    budget: TokensBytes,
    carried: TokensBytes,
    cap: TokensBytes,
    *,
    barrier_after: int = 4,
) -> VerifyAdmission:
    """One tick of 2-D deficit admission.

    In-flight demands are seated first; the rest are admitted first-fit, in order, while
    they fit in BOTH dimensions of pool = budget + carried - seated. A demand already
    skipped `barrier_after` times that does not fit is a barrier: nothing after it is
    admitted, so the pool carries over for it. Carry out = clamp(pool, 0, cap).
    Pure: inputs are not mutated, nothing else is touched.
    """
    demands = tuple(demands)
    _validate(demands, budget, carried, cap, barrier_after)

    seated = [d for d in demands if d.in_flight]
    line = [d for d in demands if not d.in_flight]
    picked, pool_tokens, pool_bytes = first_fit(
        [d.tokens for d in line],
        [d.expert_bytes for d in line],
        [d.skipped_ticks for d in line],
        budget.tokens + carried.tokens - sum(d.tokens for d in seated),
        budget.expert_bytes + carried.expert_bytes - sum(d.expert_bytes for d in seated),
        barrier_after,
    )
    return VerifyAdmission(
        seated_ids=tuple(d.seq_id for d in seated),
        admitted_ids=tuple(line[i].seq_id for i in picked),
        carried=TokensBytes(pool_tokens, pool_bytes).clamped(cap),
    )


class Column(Protocol):
    """A column read by slices ([n] int64): an array, or charges computed as they are read."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: slice, /) -> npt.NDArray[np.int64]: ...


FIRST_CHUNK = 32  # demands a long line's first look covers; each later look doubles it


def first_fit(
    tokens: Sequence[int] | npt.NDArray[np.int64],
    expert_bytes: Sequence[int] | Column,
    skipped_ticks: Sequence[int] | npt.NDArray[np.int64],
    pool_tokens: int,
    pool_bytes: int,
    barrier_after: int,
) -> tuple[list[int], int, int]:
    """The admission rule over a line given as columns ([n] each, in order, none seated; values
    below 2**62): indices of the demands admitted first-fit while they fit the pool in BOTH
    dimensions, stopping at a barrier (skipped `barrier_after` times and not fitting), and the
    pool left over (unclamped). Inputs are not checked: `admit_verify_demands` checks them."""
    if isinstance(tokens, np.ndarray):  # a long line (the scheduler's): look only where it can matter
        b = np.asarray(expert_bytes, dtype=np.int64) if isinstance(expert_bytes, Sequence) else expert_bytes
        return _first_fit_looking_ahead(tokens, b, np.asarray(skipped_ticks), pool_tokens, pool_bytes, barrier_after)
    line = zip(itertools.count(), tokens, cast(Sequence[int], expert_bytes), skipped_ticks)
    admitted = []
    for i, ti, bi, si in line:
        if ti <= pool_tokens and bi <= pool_bytes:
            admitted.append(i)
            pool_tokens -= ti
            pool_bytes -= bi
        elif si >= barrier_after:
            break  # starvation guard: the pool is saved for this demand
    return admitted, pool_tokens, pool_bytes


def _first_fit_looking_ahead(
    t: npt.NDArray[np.int64],
    b: Column,
    s: npt.NDArray[np.int64],
    pool_tokens: int,
    pool_bytes: int,
    barrier_after: int,
) -> tuple[list[int], int, int]:
    """`first_fit` reading the line in growing chunks, and not past the point where nothing
    more can fit: the pool only shrinks, so once it holds fewer tokens than any demand left
    (or negative bytes, as every charge is >= 0), the rest is neither admitted nor a barrier
    that changes anything. Within a chunk, only the demands that fit now and the guarded ones
    (the possible barriers) get a look, in order. `b` is read only up to where it looked."""
    n = len(t)
    fewest_after = np.minimum.accumulate(t[::-1])[::-1]  # [n] fewest tokens of demands i.. n-1
    admitted: list[int] = []
    lo, size = 0, FIRST_CHUNK
    while lo < n and pool_tokens >= fewest_after[lo] and pool_bytes >= 0:
        hi = min(n, lo + size)
        ti, bi, si = t[lo:hi], b[lo:hi], s[lo:hi]
        look = np.flatnonzero(((ti <= pool_tokens) & (bi <= pool_bytes)) | (si >= barrier_after))
        for i, tj, bj, sj in zip(look.tolist(), ti[look].tolist(), bi[look].tolist(), si[look].tolist()):
            if tj <= pool_tokens and bj <= pool_bytes:
                admitted.append(lo + i)
                pool_tokens -= tj
                pool_bytes -= bj
            elif sj >= barrier_after:
                return admitted, pool_tokens, pool_bytes  # starvation guard: the pool is saved for it
        lo, size = hi, 2 * size
    return admitted, pool_tokens, pool_bytes


def require_fits_cap(cap_name: str, cap: int, size: int, what: str) -> None:
    """Liveness: a demand larger than its cap could never be admitted, so that configuration is refused."""
    if size > cap:
        raise ValueError(
            f"{cap_name}={cap} is smaller than {what} ({size}), which could then never be admitted; "
            f"{cap_name} must be >= {size}"
        )


def _validate(
    demands: tuple[VerifyDemand, ...],
    budget: TokensBytes,
    carried: TokensBytes,
    cap: TokensBytes,
    barrier_after: int,
) -> None:
    if barrier_after < 0:
        raise ValueError(f"barrier_after={barrier_after} is negative; it must be >= 0")
    for name, pair in (("budget", budget), ("carried", carried), ("cap", cap)):
        for dim in ("tokens", "expert_bytes"):
            if getattr(pair, dim) < 0:
                raise ValueError(f"{name}.{dim}={getattr(pair, dim)} is negative; it must be >= 0")
    for d in demands:
        for field in ("tokens", "expert_bytes", "skipped_ticks"):
            if getattr(d, field) < 0:
                raise ValueError(
                    f"demand {d.seq_id!r} has {field}={getattr(d, field)}, which is negative; it must be >= 0"
                )
    for dim in ("tokens", "expert_bytes"):
        largest = max(demands, key=lambda d: getattr(d, dim), default=None)
        if largest is not None:
            require_fits_cap(
                f"cap.{dim}", getattr(cap, dim), getattr(largest, dim), f"the {dim} of demand {largest.seq_id!r}"
            )
