"""The intervals `evalkit.uncertainty` chooses between: Wilson's for a pass/fail score, Newcombe's
square-and-add for the difference of two paired pass/fail scores, Student's t for a mean of per-sample
differences, and scipy's percentile bootstrap for any other score (a group task's, resampled within each
task) and for perplexity, of one run or of the difference of two on the same resampled passages."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import stats

from evalkit.uncertainty.records import _by_task, _is_perplexity, _per_sample
from evalkit.uncertainty.settings import CONFIDENCE, RESAMPLES, SEED

_RESAMPLING = dict(n_resamples=RESAMPLES, method="percentile", confidence_level=CONFIDENCE, vectorized=True)


@functools.lru_cache(maxsize=4096)
def _wilson(passed: int, n: int) -> tuple[float, float]:
    low, high = stats.binomtest(passed, n).proportion_ci(CONFIDENCE, "wilson")
    return float(low), float(high)


def _newcombe_interval(both: int, only_a: int, only_b: int, neither: int) -> tuple[float, float]:
    """Newcombe's square-and-add interval for the difference of two paired proportions (Newcombe 1998,
    Statistics in Medicine 17:2635, method 10; as Fagerland, Lydersen and Laake recommend it): each run's
    Wilson interval, its distances to the run's score combined as for a sum of correlated errors, with the
    samples' phi correlation (its numerator less n/2 when positive, as theirs)."""
    n = both + only_a + only_b + neither
    score_a, score_b = (both + only_a) / n, (both + only_b) / n
    (low_a, high_a), (low_b, high_b) = _wilson(both + only_a, n), _wilson(both + only_b, n)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    association = both * neither - only_a * only_b
    association = association - n / 2 if association > n / 2 else min(association, 0)
    phi = association / math.sqrt(margins) if margins else 0.0

    def spread(x: float, y: float) -> float:
        return math.sqrt(x * x + y * y - 2 * phi * x * y)

    difference = score_a - score_b
    return (max(-1.0, difference - spread(score_a - low_a, high_b - score_b)),
            min(1.0, difference + spread(score_b - low_b, high_a - score_a)))


def _t_interval(differences: np.ndarray) -> tuple[float, float]:
    """The Student t interval of the mean of `differences`; where they are all equal it has no spread, and is
    that value (as the bootstrap's was: docs/statistics.md)."""
    if np.ptp(differences) <= 1e-12:
        return float(differences.mean()), float(differences.mean())
    low, high = stats.ttest_1samp(differences, 0.0).confidence_interval(CONFIDENCE)
    return float(low), float(high)


def _bootstrap(records: list[dict]):
    """scipy's percentile bootstrap, by sample, of the records' score. A group task's score is the mean of its
    tasks' means: its samples are resampled within each task (scipy resamples independent samples
    independently)."""
    if len(records) < 2:
        return None
    if _is_perplexity(records):
        return _perplexity_bootstrap(records)
    parts = _by_task(_per_sample(records), records)
    fixed = [float(part[0]) for part in parts if len(part) == 1]  # a task of one sample: nothing to resample
    parts = [part for part in parts if len(part) > 1]
    if not parts:
        return None

    def score(*parts, axis=-1):
        return np.mean(np.broadcast_arrays(*[part.mean(axis) for part in parts], *fixed), axis=0)

    return stats.bootstrap(parts, score, rng=np.random.default_rng(SEED), **_RESAMPLING)


def _perplexity_bootstrap(a: list[dict], b: list[dict] | None = None):
    """scipy's percentile bootstrap of a run's perplexity over its passages, or (b given) of perplexity(a) -
    perplexity(b) on the same resampled passages."""
    runs = (a,) if b is None else (a, b)
    columns = [np.array([r[key] for r in run], dtype=float) for run in runs for key in ("nll", "scored_tokens")]

    def perplexity(*columns, axis=-1):
        values = [np.exp(nll.sum(axis) / tokens.sum(axis)) for nll, tokens in zip(columns[::2], columns[1::2])]
        return values[0] if b is None else values[0] - values[1]

    return stats.bootstrap(columns, perplexity, paired=True, rng=np.random.default_rng(SEED), **_RESAMPLING)
