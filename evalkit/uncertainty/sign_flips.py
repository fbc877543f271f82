"""The paired permutation test's exact p-value where the score's per-sample terms are multiples of one common
step (shares of needles, words or tasks): the terms put on that step, and the distribution of the sum of
their sign flips worked out, so no swap is drawn at random."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from scipy import stats

FINEST_STEP = 10**6  # of the score's unit: terms on a coarser common step get the exact distribution


def _on_one_step(terms: np.ndarray) -> np.ndarray | None:
    """`terms` as integer multiples of one common step (the integers), or None where no step of at least
    1 / FINEST_STEP fits them all: a share of four needles differs by quarters, a mean over 25 samples
    weighs each by 1/25."""
    fractions = [Fraction(float(t)).limit_denominator(FINEST_STEP) for t in terms]
    if any(abs(float(f) - t) > 1e-12 for f, t in zip(fractions, terms)):
        return None
    common = math.lcm(*(f.denominator for f in fractions))
    if common > FINEST_STEP:
        return None
    return np.array([int(f * common) for f in fractions], dtype=np.int64)


def _sign_flip_p(steps: np.ndarray) -> float:
    """P(|sum of s_i * steps_i| >= |sum of steps_i|) with independent fair signs s_i: the paired permutation
    test's exact p-value. Each distinct |step| m taken c times adds m * (2j - c), j ~ Binomial(c, 1/2); the
    sum's distribution is built by shifting the one so far by each such amount."""
    observed = abs(int(steps.sum()))
    if observed == 0:  # every swap is at least as far from zero: 1, not a float sum near it
        return 1.0
    sizes, counts = np.unique(np.abs(steps[steps != 0]), return_counts=True)
    reach = int((sizes * counts).sum())
    distribution = np.zeros(2 * reach + 1)  # P(sum = s) at index s + reach
    distribution[reach] = 1.0
    for size, count in zip(sizes.tolist(), counts.tolist()):
        heads = stats.binom.pmf(np.arange(count + 1), count, 0.5)
        # np.roll never wraps a nonzero: the sum so far and this size's shifts together stay within reach.
        distribution = sum(probability * np.roll(distribution, size * (2 * j - count))
                           for j, probability in enumerate(heads))
    far = np.abs(np.arange(-reach, reach + 1)) >= observed
    # Never 0: the true p is at least 2 / 2^n, which a float cannot hold past n ~ 1,000.
    return float(np.clip(distribution[far].sum(), np.finfo(float).tiny, 1.0))
