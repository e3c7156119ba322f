"""Pearson's chi-square goodness-of-fit test for the sampling tests (scipy is not in the test environment).

The p-value is the chi-square survival function, the regularised upper incomplete gamma
Q(dof / 2, x / 2) (`torch.special.gammaincc`); `tests/test_chi_square.py` checks it against a
closed form and published table values.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class ChiSquare:
    statistic: float
    dof: int
    p_value: float  # P(a chi-square variable with `dof` degrees of freedom ≥ statistic)

    def __str__(self) -> str:
        return f"chi2={self.statistic:.1f} with {self.dof} dof, p={self.p_value:.2e}"


def survival(statistic: float, dof: int) -> float:
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> ChiSquare:
    """[K] observed counts against [K] probabilities (summing to 1).

    Categories expected fewer than `min_expected` times are pooled into one (the usual validity
    rule for the chi-square approximation); a count in a category of probability 0 fails the
    test outright (p = 0), since no amount of sampling noise explains it.
    """
    counts, probs = counts.double(), probs.double()
    if counts[probs <= 0].sum() > 0:
        return ChiSquare(float("inf"), 0, 0.0)
    expected = probs * counts.sum()
    large = expected >= min_expected
    observed = torch.cat([counts[large], counts[~large].sum()[None]])
    wanted = torch.cat([expected[large], expected[~large].sum()[None]])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(keep.sum()) - 1
    return ChiSquare(statistic, dof, survival(statistic, dof) if dof > 0 else 1.0)
