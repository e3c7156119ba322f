"""The pure 2-D deficit admission of pending verifies (ARCHITECTURE "2-D deficit admission").

Owns the (tokens, expert bytes) value type every budget, cap, carried deficit and pool is
written in, the one-tick admission function and its input checks, including the liveness
rule that a cap must hold the largest single demand, and its first-fit rule over a line pulled
one demand at a time (`first_fit_stream`, which the scheduler calls with inputs it checked at
registration). Pure: no I/O, no mutation, no clock; the ticket scheduler
(pdflash.engine.scheduler) owns order, tickets and the carry.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs


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


def first_fit(
    tokens: Sequence[int],
    expert_bytes: Sequence[int],
    skipped_ticks: Sequence[int],
    pool_tokens: int,
    pool_bytes: int,
    barrier_after: int,
) -> tuple[list[int], int, int]:
    """The admission rule over a line given as columns ([n] each, in order, none seated):
    `first_fit_stream` over them. Inputs are not checked: `admit_verify_demands` checks them."""
    line = zip(tokens, expert_bytes, skipped_ticks, strict=True)
    return first_fit_stream(line, pool_tokens, pool_bytes, barrier_after, min(tokens, default=0))


def first_fit_stream(
    line: Iterable[tuple[int, int, int]],
    pool_tokens: int,
    pool_bytes: int,
    barrier_after: int,
    fewest_tokens: int,
) -> tuple[list[int], int, int]:
    """Indices of the demands of `line` ((tokens, bytes, skipped ticks) each, in order, none
    seated) admitted first-fit while they fit the pool in BOTH dimensions, stopping at a barrier
    (skipped `barrier_after` times and not fitting), and the pool left over (unclamped).

    `line` is pulled one demand at a time, and not past the point where nothing more can fit:
    the pool only shrinks, so once it holds fewer than `fewest_tokens` (a lower bound on the
    tokens of every demand left) or negative bytes (every charge is >= 0), the rest is neither
    admitted nor a barrier that changes anything. A line whose charges are counted as it is
    pulled (the scheduler's marginal charges) is counted only that far.
    """
    admitted: list[int] = []
    if pool_tokens < fewest_tokens or pool_bytes < 0:
        return admitted, pool_tokens, pool_bytes
    for i, (tokens, expert_bytes, skipped) in enumerate(line):
        if tokens <= pool_tokens and expert_bytes <= pool_bytes:
            admitted.append(i)
            pool_tokens -= tokens
            pool_bytes -= expert_bytes
            if pool_tokens < fewest_tokens:
                break  # nothing left fits
        elif skipped >= barrier_after:
            break  # starvation guard: the pool is saved for this demand
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
