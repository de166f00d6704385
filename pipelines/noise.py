"""How sure a number is: 95% intervals for test metrics, and whether a difference exceeds the noise.

Accuracy over n test rows is a binomial proportion: its interval is Wilson's score interval,
which stays inside [0, 1] and is right for small n (the normal approximation is not). Macro-F1
has no closed form, so its interval is a seeded percentile bootstrap over the test rows.
A difference between two variants is "within noise" unless it exceeds the two-sided 95% critical value
times the standard error of the difference. Repeated over seeds, that is Welch's t: the standard error from
the seeds' spreads and Student's t quantile at the Welch-Satterthwaite degrees of freedom (with n = 2 per
side, about 4.3, not 1.96: a normal quantile would mark far too much). One run each, only accuracy has a
noise estimate, the binomial standard errors of both trials, with the normal quantile.

Why by hand, not scipy.stats (a review asked, issue 71): `import scipy.stats` takes 0.68-0.75 s on 2 cores, and
Wilson's interval is needed by every trial's test scoring and every report, processes whose start-up is the fixed
cost of an experiment (benchmarks/RESULTS.md, issue 69); Wilson's formula is 7 lines. Welch's standard error and
degrees of freedom are kept as a pair because `exceeds_noise` takes both. tests/pipelines/test_noise.py checks all
three against scipy (`binomtest(...).proportion_ci(method="wilson")`, `ttest_ind(equal_var=False)`,
`t.interval`) to 1e-12; scipy's t quantile is used as it is (`critical_value`), imported only when repeats exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054
BOOTSTRAP_SAMPLES = 1000


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion of `successes` in `n` trials."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def confusion_counts(labels: np.ndarray, predicted: np.ndarray, num_labels: int) -> np.ndarray:
    """Counts of (actual, predicted) label ids, actual by row (sklearn.metrics.confusion_matrix's layout)."""
    pairs = np.asarray(labels, dtype=np.int64) * num_labels + np.asarray(predicted, dtype=np.int64)
    return np.bincount(pairs, minlength=num_labels * num_labels).reshape(num_labels, num_labels)


def per_class_scores(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall and F1 per class from confusion matrices (the last two axes), 0 where undefined.

    From counts, not sklearn.metrics: the same arithmetic (F1 = 2 tp / (actual + predicted); sklearn's
    zero_division=0), without sklearn's import, 0.6 s of each trial's CPU and 1.2 s of the evaluate stage's
    here (tests/pipelines/test_evaluation.py checks it against sklearn)."""
    tp = np.einsum("...ii->...i", confusion).astype(float)
    actual, guessed = confusion.sum(axis=-1), confusion.sum(axis=-2)

    def ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
        return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)

    return ratio(tp, guessed), ratio(tp, actual), ratio(2 * tp, actual + guessed)


def bootstrap_macro_f1_interval(
    labels: np.ndarray, predicted: np.ndarray, num_labels: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of macro-F1, resampling test rows with replacement (seeded)."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    if n == 0:
        return 0.0, 1.0
    pair = np.asarray(labels) * num_labels + np.asarray(predicted)
    # One confusion matrix per resample, from counts: sklearn's f1_score per resample is 100x slower.
    idx = rng.integers(0, n, size=(samples, n))
    offsets = (np.arange(samples) * num_labels * num_labels)[:, None]
    counts = np.bincount((pair[idx] + offsets).ravel(), minlength=samples * num_labels * num_labels)
    _, _, f1 = per_class_scores(counts.reshape(samples, num_labels, num_labels))
    low, high = np.percentile(f1.mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def binomial_se(p: float, n: float) -> float:
    """Standard error of a proportion p over n rows."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else math.inf


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def critical_value(df: float | None) -> float:
    """The two-sided 95% critical value: Student's t at `df` degrees of freedom, or the normal's when None."""
    if df is None or not math.isfinite(df):
        return Z95
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def exceeds_noise(difference: float, standard_error: float, df: float | None = None) -> bool:
    """Whether |difference| is beyond the 95% critical value (t at `df`, else normal) times its standard error.

    A standard error of 0 (exact byte counts, or repeats that agree to the byte) marks any difference.
    """
    if standard_error == 0:
        return difference != 0
    return abs(difference) > critical_value(df) * standard_error


def repeats_se(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None] | None:
    """(standard error, Welch-Satterthwaite df) of mean(a) - mean(b) from the repeats' spreads.

    None unless both sides were repeated; df None when both spreads are 0 (the difference is then exact).
    """
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = mean_sd(a)[1] ** 2 / len(a), mean_sd(b)[1] ** 2 / len(b)
    if va + vb == 0:
        return 0.0, None
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return math.sqrt(va + vb), df


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """The 95% interval of the mean of `values` (two or more): Student's t at n - 1 degrees of freedom."""
    mean, sd = mean_sd(values)
    half = critical_value(len(values) - 1) * sd / math.sqrt(len(values))
    return mean - half, mean + half
