"""How many samples a paired comparison needs to detect a given difference (`samples_needed`): the exact
McNemar test's own power for pass/fail scores, worked out from binomial distributions at every n in turn,
and the normal approximation for other scores."""

from __future__ import annotations

import functools
import itertools

import numpy as np
from scipy import stats

from evalkit.errors import EvalkitError
from evalkit.uncertainty.settings import ALPHA, POWER

# Without an observed disagreement rate, two runs are assumed to disagree on half the samples (what two
# independent runs scoring near 50 % do): more samples than paired runs usually need.
DEFAULT_DISCORDANCE = 0.5
DEFAULT_DIFFERENCE_SD = 0.5  # the same for continuous scores in [0, 1]


@functools.lru_cache(maxsize=256)  # pure, and a sweep's plan asks the same question for every cell
def samples_needed(detect: float, discordance: float | None = None, difference_sd: float | None = None) -> int:
    """Samples a paired comparison needs to detect a difference of `detect` (a fraction of the score range)
    with the power POWER at the level ALPHA: for pass/fail scores, the exact McNemar test's own power at the
    disagreement rate `discordance` (DEFAULT_DISCORDANCE when unknown, or below `detect`); otherwise the
    normal approximation with the per-sample differences' standard deviation `difference_sd`."""
    if not 0 < detect < 1:
        raise EvalkitError(f"the difference to detect must be in (0, 100) points, got {detect * 100:g}")
    if difference_sd is not None:
        z = stats.norm.ppf(1 - ALPHA / 2) + stats.norm.ppf(POWER)
        return int(np.ceil((z * difference_sd / detect) ** 2))
    discordance = max(discordance or DEFAULT_DISCORDANCE, detect)
    toward_a = (discordance + detect) / (2 * discordance)  # of the disagreements, the share A wins
    # Every n in turn, so the first that reaches the power is the smallest (an exact test's power need not
    # rise with every sample): P(m disagreements | n) is carried from n - 1 to n, the power given m worked out
    # once per m.
    disagreements = np.array([1.0])  # P(m disagreements among n = 0 samples), m = 0..n
    reject = _mcnemar_rejection(np.arange(64), toward_a)
    for n in itertools.count(1):
        before, disagreements = disagreements, np.zeros(n + 1)
        disagreements[:-1] += before * (1 - discordance)  # the n-th pair agrees
        disagreements[1:] += before * discordance  # or disagrees
        if n >= len(reject):
            reject = np.r_[reject, _mcnemar_rejection(np.arange(len(reject), 2 * len(reject)), toward_a)]
        if disagreements @ reject[: n + 1] >= POWER:
            return n


def _mcnemar_rejection(disagreements: np.ndarray, toward_a: float) -> np.ndarray:
    """P(the exact two-sided McNemar test rejects at ALPHA | m disagreements, each A's with P `toward_a`), per m."""
    # The largest count c with a two-sided exact p-value 2 * P(X <= c | m, 1/2) <= ALPHA; -1 where none.
    critical = stats.binom.ppf(ALPHA / 2, disagreements, 0.5).astype(int)
    critical = np.where(2 * stats.binom.cdf(critical, disagreements, 0.5) <= ALPHA, critical, critical - 1)
    reject = stats.binom.cdf(critical, disagreements, toward_a) + \
        stats.binom.sf(disagreements - critical - 1, disagreements, toward_a)
    return np.where(critical >= 0, reject, 0.0)


def _mcnemar_power(n: int, discordance: float, toward_a: float) -> float:
    """The exact McNemar test's power on n pairs (`samples_needed`'s, at one n)."""
    disagreements = np.arange(n + 1)
    return float(stats.binom.pmf(disagreements, n, discordance) @ _mcnemar_rejection(disagreements, toward_a))
