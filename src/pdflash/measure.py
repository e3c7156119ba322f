"""Small measurement formulas shared by every report: decode rate and nearest-rank percentiles.

Owns the arithmetic only; callers own their clocks and samples.
"""

from __future__ import annotations


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
