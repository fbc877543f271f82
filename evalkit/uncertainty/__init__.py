"""How sure a score is, and whether two runs on the same samples differ. The mathematics is scipy's; this
module decides which method fits which scores (docs/statistics.md).

- Every per-sample score 0 or 1 (a needle found or not): the run's score has a Wilson score interval
  (`scipy.stats.binomtest(...).proportion_ci(method="wilson")`), and two runs are compared with the exact
  McNemar test: a two-sided binomial test at 1/2 on the samples where exactly one of them passed.
- Any other score (F1, ROUGE, a share of needles, perplexity): a percentile bootstrap over samples
  (`scipy.stats.bootstrap`, `RESAMPLES` resamples, seed `SEED`) of the run's own aggregate (the mean; the
  mean of its tasks' means, resampled within each task; perplexity over all scored tokens), and two runs
  are compared with a paired permutation test (`scipy.stats.permutation_test`): under the null hypothesis
  the two runs' results on a sample are exchangeable, so each sample's pair may be swapped; the p-value is the
  share of swaps whose score difference is at least as far from zero as the one observed. Exact where the
  score's per-sample terms are multiples of one step (shares of needles, words or tasks: the distribution of
  the sum of their sign flips, worked out), or up to EXACT_UP_TO samples (every swap enumerated); otherwise
  RESAMPLES random swaps with seed SEED. It holds its level at any n, where the bootstrap's p-value (the
  resampled differences centred on zero) rejects too often on few samples.
The difference of two runs carries an interval that holds near its 95 % on few samples, where the percentile
bootstrap evalkit used before was too narrow: pass/fail scores (and group tasks of equal tasks of them) get
Newcombe's square-and-add interval for paired proportions (Wilson intervals of the two runs' scores,
combined with their correlation), other scores linear in the samples' the Student t interval of the weighted
per-sample differences (`scipy.stats.ttest_1samp`), perplexity a paired percentile bootstrap.

The parts, by what they hold (underscore names are the package's own, shared between its modules):
settings.py (confidence, level, power, resamples, seed), records.py (a run's records as scores, weights and
its score), intervals.py (Wilson, Newcombe, Student t, bootstrap), sample_size.py (`samples_needed`),
sign_flips.py (the permutation test's exact distribution); this module chooses between them, and holds the
paired permutation test.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from evalkit.errors import EvalkitError
from evalkit.uncertainty.intervals import (_bootstrap, _newcombe_interval, _perplexity_bootstrap, _t_interval,
                                           _wilson)
from evalkit.uncertainty.records import (_is_perplexity, _per_sample, _tasks, _weights, in_id_order, is_binary,
                                         score_of)
from evalkit.uncertainty.sample_size import samples_needed
from evalkit.uncertainty.sample_size import _mcnemar_power  # noqa: F401  (tests/test_uncertainty.py imports it here)
from evalkit.uncertainty.settings import ALPHA, CONFIDENCE, RESAMPLES, SEED
from evalkit.uncertainty.sign_flips import _on_one_step, _sign_flip_p


@dataclass
class Interval:
    n: int
    ci_low: float | None  # None: a bootstrap of fewer than two samples says nothing
    ci_high: float | None
    ci_method: str  # "wilson" or "bootstrap"
    ci_level: float = CONFIDENCE
    ci_resamples: int | None = None  # bootstrap only, as its seed
    ci_seed: int | None = None

    def as_metrics(self) -> dict:
        return asdict(self)


@dataclass
class Comparison:
    n: int
    metric: str  # "binary" or "continuous"
    difference: float  # score of A minus score of B, in score units (a fraction for binary scores)
    ci_low: float
    ci_high: float
    interval: str  # "Newcombe", "Student t" or "paired bootstrap"
    p_value: float
    test: str  # "exact McNemar" or "paired permutation"
    only_a: int  # samples where A scored higher than B (binary: passed where B failed)
    only_b: int
    needed: int | None  # samples to detect `detect` at the observed disagreement, ALPHA and POWER
    detect: float | None
    higher_is_better: bool = True

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA

    @property
    def interval_disagrees(self) -> bool:
        """The interval (an approximation) excludes no difference where the test finds none, or the other way
        round: at a few samples Newcombe's interval and the exact test can part. The test decides."""
        return (self.ci_low > 0 or self.ci_high < 0) != self.significant

    def verdict(self, a: str = "A", b: str = "B") -> str:
        caveat = "; the interval, an approximation, disagrees at this n: the test decides" \
            if self.interval_disagrees else ""
        if self.significant:
            a_wins = (self.difference > 0) == self.higher_is_better
            return f"{a if a_wins else b} better, p = {self.p_value:.3g}{caveat}"
        found = f"no difference detected at n = {self.n} (p = {self.p_value:.3g}){caveat}"
        if self.detect is None:
            return found
        need = f"; would need ≈ {self.needed} samples" if self.needed else ""
        return f"{found}{need} to detect a {self.detect * 100:g}-point difference"


def score_interval(records: list[dict]) -> Interval:
    """The 95 % interval of the score `evaluations.aggregate` gives these records."""
    if not records:
        raise EvalkitError("no samples: a score needs at least one")
    records = in_id_order(records)  # the bootstrap's resamples then do not depend on the file's line order
    n = len(records)
    if is_binary(records) and not _tasks(records) and not _is_perplexity(records):
        return Interval(n, *_wilson(sum(int(r["score"]) for r in records), n), "wilson")
    result = _bootstrap(records)
    low, high = result.confidence_interval if result is not None else (None, None)
    return Interval(n, _float(low), _float(high), "bootstrap", ci_resamples=RESAMPLES, ci_seed=SEED)


def compare(a: list[dict], b: list[dict], detect: float | None = 0.10) -> Comparison:
    """Paired comparison of two runs' records on the same samples (matched by id); `detect`: the difference
    `needed` is worked out for (None: not worked out, as the report's many tests do not need it)."""
    a = in_id_order(a)
    by_id = {r["id"]: r for r in b}
    if not a or {r["id"] for r in a} != set(by_id):
        only = len({r["id"] for r in a} ^ set(by_id))
        raise EvalkitError(f"the runs hold different samples ({len(a)} and {len(b)}, {only} not in both): "
                           "a paired comparison needs the same samples")
    b = [by_id[r["id"]] for r in a]
    if _is_perplexity(a) != _is_perplexity(b):
        raise EvalkitError("one run scores perplexity and the other does not: they cannot be compared")
    unscored = [r["id"] for r in a + b if not np.isfinite(float(r["score"]))]
    if unscored:
        raise EvalkitError(f"sample {unscored[0]} has no finite score: a paired comparison needs every score")
    if len(a) < 2:
        raise EvalkitError("1 sample: a paired comparison needs at least two")
    difference = score_of(a) - score_of(b)
    scores_a, scores_b = _per_sample(a), _per_sample(b)
    only_a, only_b = int((scores_a > scores_b).sum()), int((scores_a < scores_b).sum())
    perplexity = _is_perplexity(a)
    higher_is_better = not perplexity
    if perplexity:
        only_a, only_b = only_b, only_a
    pass_fail = is_binary(a) and is_binary(b) and not perplexity
    both = int((scores_a * scores_b).sum())
    pairs = (both, only_a, only_b, len(a) - both - only_a - only_b)
    if pass_fail and not _tasks(a):
        p = 1.0 if only_a + only_b == 0 else float(stats.binomtest(only_a, only_a + only_b).pvalue)
        needed = None if detect is None else samples_needed(detect, (only_a + only_b) / len(a) or None)
        return Comparison(len(a), "binary", difference, *_newcombe_interval(*pairs), "Newcombe", p,
                          "exact McNemar", only_a, only_b, needed, detect, higher_is_better)
    p = _permutation_p(a, b)
    weights = _weights(a)
    weighted = len(a) * weights * (scores_a - scores_b)  # their mean: the difference of the scores
    if perplexity:
        low, high, interval = *_perplexity_bootstrap(a, b).confidence_interval, "paired bootstrap"
    elif pass_fail and np.ptp(weights) == 0:  # a group task of equal tasks: its score is the pooled share passed
        low, high, interval = *_newcombe_interval(*pairs), "Newcombe"
    else:
        low, high, interval = *_t_interval(weighted), "Student t"
        if all(0 <= s <= 1 for s in np.r_[scores_a, scores_b]):  # shares, F1: a difference within [-1, 1]
            low, high = max(low, -1.0), min(high, 1.0)
    sd = float(np.std(weighted, ddof=1))
    needed = None if detect is None or not higher_is_better else samples_needed(detect, difference_sd=sd or None)
    return Comparison(len(a), "continuous", difference, float(low), float(high), interval, p, "paired permutation",
                      only_a, only_b, needed, detect, higher_is_better)


def holm(p_values) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in the order given: the k-th smallest is multiplied
    by (m - k + 1), then made no smaller than the one before it, at most 1. The same values as statsmodels'
    `multipletests(method="holm")` (tests/test_uncertainty.py), which calls `gc.collect()` on every call: a
    quarter of a second each once torch is imported, and a report or a study table adjusts hundreds of
    families."""
    p = np.asarray(p_values, dtype=float)
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate(p[order] * np.arange(len(p), 0, -1))
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted.tolist()


def _float(value) -> float | None:
    return None if value is None else float(value)


EXACT_UP_TO = 16  # samples: up to 2^16 swaps are all enumerated, beyond that RESAMPLES random ones
_TIE = 1e-9  # of the score (relative, for perplexity): swaps this close to the observed distance are ties
LONGEST_DISTRIBUTION = 10**7  # values of the sum of sign flips held at once (80 MB): beyond, random swaps


def _permutation_p(a: list[dict], b: list[dict]) -> float:
    """Two-sided p-value of score(a) - score(b) under swaps of each sample's pair of results: the share of
    swaps whose |difference| is at least the observed one. A score linear in the samples' scores swaps as a
    sign flip of each sample's weighted difference; perplexity swaps the pairs of two index arrays, [0, n)
    for A and [n, 2n) for B, into both runs' (nll, scored tokens)."""
    n = len(a)
    if _is_perplexity(a):
        nll = np.array([r["nll"] for r in a + b], dtype=float)
        tokens = np.array([r["scored_tokens"] for r in a + b], dtype=float)

        def distance(of_a, of_b, axis=-1):
            return np.abs(np.exp(nll[of_a].sum(axis) / tokens[of_a].sum(axis))
                          - np.exp(nll[of_b].sum(axis) / tokens[of_b].sum(axis)))
        data, tie = (np.arange(n), np.arange(n, 2 * n)), _TIE * max(score_of(a), score_of(b))
    else:
        terms = _weights(a) * (_per_sample(a) - _per_sample(b))
        steps = _on_one_step(terms)
        if steps is not None and 2 * np.abs(steps).sum() + 1 <= LONGEST_DISTRIBUTION:
            return _sign_flip_p(steps)

        def distance(weighted_differences, axis=-1):
            return np.abs(weighted_differences.sum(axis))
        data, tie = (terms,), _TIE
    exact = n <= EXACT_UP_TO
    result = stats.permutation_test(data, distance, permutation_type="samples", vectorized=True, batch=4_096,
                                    n_resamples=2**n if exact else RESAMPLES, rng=np.random.default_rng(SEED))
    # Counted here, not by scipy, whose tolerance for ties is relative to the observed distance (none at 0).
    at_least = int((result.null_distribution >= result.statistic - tie).sum())
    return at_least / 2**n if exact else (at_least + 1) / (RESAMPLES + 1)
