"""pipelines/noise.py against scipy.stats, the library it would be replaced by (issue 71): Wilson's interval equals
`binomtest(...).proportion_ci(method="wilson")`, and the repeats' standard error and degrees of freedom give
`ttest_ind(equal_var=False)`'s statistic and df. Kept by hand for what importing scipy.stats costs each process
(noise.py's docstring has the figure); these tests keep them equal."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import binomtest, t, ttest_ind

from pipelines.noise import mean_interval, repeats_se, wilson_interval


@pytest.mark.parametrize("n", [1, 2, 7, 30, 100, 1200, 7600])
def test_wilsons_interval_equals_scipys(n):
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
        expected = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        low, high = wilson_interval(k, n)
        assert (low, high) == pytest.approx((expected.low, expected.high), abs=1e-12), (k, n)


def test_welchs_standard_error_and_df_give_scipys_t_and_df():
    rng = np.random.default_rng(0)
    for size_a, size_b in itertools.product((2, 3, 5), (2, 4)):
        a, b = rng.normal(10, 1, size_a), rng.normal(10.5, 2, size_b)
        se, df = repeats_se(list(a), list(b))
        expected = ttest_ind(a, b, equal_var=False)
        assert (a.mean() - b.mean()) / se == pytest.approx(expected.statistic, rel=1e-12)
        assert df == pytest.approx(expected.df, rel=1e-12)


def test_the_mean_interval_equals_scipys_t_interval():
    values = [5.7, 6.1, 5.9, 6.4]
    mean, sem = np.mean(values), np.std(values, ddof=1) / np.sqrt(len(values))
    expected = t.interval(0.95, len(values) - 1, loc=mean, scale=sem)
    assert mean_interval(values) == pytest.approx(expected, rel=1e-12)
