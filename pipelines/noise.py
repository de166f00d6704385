"""How sure a number is: 95% intervals for test metrics, and whether a difference exceeds the noise.

Accuracy over n test rows is a binomial proportion: its interval is Wilson's score interval,
which stays inside [0, 1] and is right for small n (the normal approximation is not). Macro-F1
has no closed form, so its interval is a seeded percentile bootstrap over the test rows.
A difference between two trials is "within noise" unless it exceeds 1.96 standard errors of
the difference: from the seeds' spread when variants were repeated, else (for accuracy) from the
binomial standard errors of both trials.
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
    confusion = counts.reshape(samples, num_labels, num_labels)
    tp = np.einsum("sii->si", confusion)
    actual, guessed = confusion.sum(axis=2), confusion.sum(axis=1)
    denominator = actual + guessed
    # sklearn's zero_division=0: a class with neither rows nor predictions scores 0.
    f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp, dtype=float), where=denominator > 0)
    low, high = np.percentile(f1.mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def binomial_se(p: float, n: float) -> float:
    """Standard error of a proportion p over n rows."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else math.inf


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def exceeds_noise(difference: float, standard_error: float) -> bool:
    """Whether |difference| is beyond 1.96 standard errors (a 95% two-sided test)."""
    return abs(difference) > Z95 * standard_error


def repeats_se(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Standard error of mean(a) - mean(b) from the repeats' spreads; None unless both were repeated."""
    if len(a) < 2 or len(b) < 2:
        return None
    return math.sqrt(mean_sd(a)[1] ** 2 / len(a) + mean_sd(b)[1] ** 2 / len(b))
