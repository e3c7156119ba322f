"""The chi-square helper the sampling tests rely on: its p-values against a closed form and table values."""

import math

import pytest
import torch
from chi_square import chi_square, survival


@pytest.mark.parametrize("x", [0.5, 3.0, 13.8])
def test_two_dof_survival_is_the_closed_form(x):
    assert survival(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


@pytest.mark.parametrize(("quantile", "dof"), [(10.828, 1), (20.515, 5), (29.588, 10), (59.703, 30)])
def test_table_quantiles_at_p_0_001(quantile, dof):
    """The 0.999 quantiles printed in standard chi-square tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4)."""
    assert survival(quantile, dof) == pytest.approx(0.001, rel=2e-3)


def test_matching_counts_pass_and_shifted_counts_fail():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert chi_square(torch.tensor([500, 300, 200, 0]), probs).p_value == pytest.approx(1.0)
    assert chi_square(torch.tensor([560, 260, 180, 0]), probs).p_value < 1e-3
    assert chi_square(torch.tensor([500, 300, 199, 1]), probs).p_value == 0.0  # a token of probability 0


def test_rare_categories_are_pooled():
    probs = torch.tensor([0.99, 0.004, 0.003, 0.003])  # 1000 draws: the last three expected < 5 each
    result = chi_square(torch.tensor([990, 4, 3, 3]), probs)
    assert result.dof == 1 and result.p_value == pytest.approx(1.0)
