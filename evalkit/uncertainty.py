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
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np
from scipy import stats

from evalkit.errors import EvalkitError

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
ALPHA = 0.05  # of the paired tests, and of `samples_needed`
POWER = 0.8  # of `samples_needed`
# Without an observed disagreement rate, two runs are assumed to disagree on half the samples (what two
# independent runs scoring near 50 % do): more samples than paired runs usually need.
DEFAULT_DISCORDANCE = 0.5
DEFAULT_DIFFERENCE_SD = 0.5  # the same for continuous scores in [0, 1]
_RESAMPLING = dict(n_resamples=RESAMPLES, method="percentile", confidence_level=CONFIDENCE, vectorized=True)


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


def in_id_order(records: list[dict]) -> list[dict]:
    """The records sorted by id (as JSON, so any id sorts; numbers in it by value: s2 before s10): what is
    computed from them, resamples included, is the same however a file's lines are ordered."""
    def key(record):
        parts = re.split(r"(\d+)", json.dumps(record["id"], sort_keys=True))
        return [int(part) if i % 2 else part for i, part in enumerate(parts)]

    return sorted(records, key=key)


def is_binary(records: list[dict]) -> bool:
    return all(r["score"] in (0, 1) for r in records)


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


def _float(value) -> float | None:
    return None if value is None else float(value)


def _tasks(records: list[dict]) -> list[str]:
    """The tasks of a group task's samples (meta["task"]), in order; empty for a single task."""
    return sorted({r["meta"]["task"] for r in records if "task" in r.get("meta", {})})


def _is_perplexity(records: list[dict]) -> bool:
    return all("nll" in r and "scored_tokens" in r for r in records)


def _per_sample(records: list[dict]) -> np.ndarray:
    return np.array([float(r["score"]) for r in records])


def score_of(records: list[dict]) -> float:
    """The score `evaluations.aggregate` (perplexity: `perplexity_metrics`) gives these records."""
    if _is_perplexity(records):
        return float(np.exp(sum(r["nll"] for r in records) / sum(r["scored_tokens"] for r in records)))
    by_task = _by_task(_per_sample(records), records)
    return float(np.mean([scores.mean() for scores in by_task]))


def _by_task(values: np.ndarray, records: list[dict]) -> list[np.ndarray]:
    """`values` [n] split by the task of each sample (one part for a single task)."""
    tasks = _tasks(records)
    if not tasks:
        return [values]
    of = np.array([r["meta"]["task"] for r in records])
    return [values[of == task] for task in tasks]


def _weights(records: list[dict]) -> np.ndarray:
    """Each sample's weight [n] in the score: the mean of the tasks' means is linear in the samples' scores."""
    parts = _by_task(np.arange(len(records)), records)
    weight = np.zeros(len(records))
    for part in parts:
        weight[part] = 1 / (len(parts) * len(part))
    return weight


EXACT_UP_TO = 16  # samples: up to 2^16 swaps are all enumerated, beyond that RESAMPLES random ones
_TIE = 1e-9  # of the score (relative, for perplexity): swaps this close to the observed distance are ties
FINEST_STEP = 10**6  # of the score's unit: terms on a coarser common step get the exact distribution
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
