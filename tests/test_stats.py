"""The benchmarks' and tests' shared statistics (loadtest/stats.py) against references."""
from __future__ import annotations

import pytest
import torch

from loadtest.stats import chi2_sf, chi_square_p, homogeneity_p


@pytest.mark.parametrize("x2,df", [(0.01, 4), (0.5, 1), (3.5, 3), (10.0, 3), (2.0, 6), (30.0, 10), (100.0, 20)])
def test_chi_square_tail_matches_torchs_incomplete_gamma(x2, df):
    reference = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x2 / 2, dtype=torch.float64))
    assert chi2_sf(x2, df) == pytest.approx(float(reference), rel=1e-9, abs=1e-15)


def test_goodness_of_fit_and_homogeneity_on_known_counts():
    assert chi_square_p([50, 50], [0.5, 0.5]) == pytest.approx(1.0)
    assert chi_square_p([90, 10], [0.5, 0.5]) < 1e-10  # X² = 64, df 1
    assert homogeneity_p([30, 70], [30, 70]) == pytest.approx(1.0)
    # categories expected fewer than 5 times are pooled into one: [1, 1] of [0.01, 0.01] counted as 2 of 0.02
    assert chi_square_p([90, 8, 1, 1], [0.9, 0.08, 0.01, 0.01], min_expected=5) == \
        pytest.approx(chi_square_p([90, 8, 2], [0.9, 0.08, 0.02]))
    assert chi_square_p([45, 55], [1.0, 1.0]) == pytest.approx(chi_square_p([45, 55], [0.5, 0.5]))
    # X² of the 2x2 table [[60, 40], [40, 60]] is 8, df 1
    assert homogeneity_p([60, 40], [40, 60]) == pytest.approx(chi2_sf(8.0, 1))


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_units():
    from loadtest.stats import bootstrap_interval

    few = bootstrap_interval([float(v % 10) for v in range(20)])
    many = bootstrap_interval([float(v % 10) for v in range(2000)])
    assert few[1] < 4.5 < few[2] and many[1] < 4.5 < many[2]
    assert many[2] - many[1] < (few[2] - few[1]) / 5
    assert bootstrap_interval([2.0] * 7) == (2.0, 2.0, 2.0)
    assert bootstrap_interval([1.0, 3.0]) == bootstrap_interval([1.0, 3.0])  # seeded: reruns agree
    pairs = [(1.0, 0.0)] * 10
    assert bootstrap_interval(pairs, lambda u: sum(a - b for a, b in u) / len(u)) == (1.0, 1.0, 1.0)
