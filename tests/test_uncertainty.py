"""Intervals and paired tests (`evalkit.uncertainty`) against statsmodels' and scipy's own values."""

import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, strategies as st
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint
from statsmodels.stats.weightstats import DescrStatsW

from evalkit.errors import EvalkitError
from evalkit.evaluations import aggregate
from evalkit.tasks.ppl import perplexity_metrics
from evalkit import uncertainty
from evalkit.uncertainty import (ALPHA, RESAMPLES, SEED, _mcnemar_power, _on_one_step, compare, holm, score_of,
                                 samples_needed, score_interval)


def binary(scores, task=None):
    return [{"id": f"s{i}", "score": float(s), **({"meta": {"task": task[i]}} if task else {})}
            for i, s in enumerate(scores)]


@pytest.mark.parametrize("passed, n", [(0, 20), (20, 20), (3, 20), (1, 1), (0, 1), (57, 100), (1, 1000)])
def test_binary_scores_get_the_wilson_interval(passed, n):
    interval = score_interval(binary([1] * passed + [0] * (n - passed)))
    low, high = proportion_confint(passed, n, alpha=0.05, method="wilson")
    assert interval.ci_method == "wilson" and interval.n == n
    assert interval.ci_low == pytest.approx(low, abs=1e-12) and interval.ci_high == pytest.approx(high, abs=1e-12)
    assert interval.ci_low <= passed / n <= interval.ci_high


def test_other_scores_get_scipys_percentile_bootstrap_near_the_t_interval():
    scores = np.random.default_rng(1).uniform(0, 1, 400).round(3)
    interval = score_interval(binary(scores))
    own = stats.bootstrap((scores,), np.mean, n_resamples=RESAMPLES, method="percentile",
                          rng=np.random.default_rng(SEED)).confidence_interval
    assert (interval.ci_low, interval.ci_high) == (own.low, own.high)
    assert (interval.ci_method, interval.ci_resamples, interval.ci_seed) == ("bootstrap", RESAMPLES, SEED)
    low, high = DescrStatsW(scores).tconfint_mean(0.05)
    assert interval.ci_low == pytest.approx(low, abs=0.005) and interval.ci_high == pytest.approx(high, abs=0.005)


def test_intervals_and_paired_tests_do_not_depend_on_the_order_of_the_lines():
    rng = np.random.default_rng(2)
    shares = binary(rng.integers(0, 5, 30) / 4)
    other = binary(rng.integers(0, 5, 30) / 4)
    passages = [{"id": f"p{i}", "score": 0.0, "nll": float(rng.uniform(20, 60)), "scored_tokens": int(10 + i),
                 "buckets": [], "meta": {"text": "t"}} for i in range(12)]
    shorter = [{**p, "nll": p["nll"] * 0.9} for p in passages]
    for a, b in [(shares, other), (passages, shorter)]:
        shuffled = [a[i] for i in rng.permutation(len(a))]
        assert score_interval(shuffled) == score_interval(a)
        assert compare(shuffled, b) == compare(a, b)
        assert compare(b, shuffled) == compare(b, a)


def test_one_sample_of_a_continuous_score_has_no_interval_and_none_has_no_score():
    interval = score_interval(binary([0.5]))
    assert interval.n == 1 and interval.ci_low is None and interval.ci_high is None
    with pytest.raises(EvalkitError, match="no samples"):
        score_interval([])


def test_the_bootstrap_resamples_the_score_the_run_reports():
    group = binary([1, 0, 1, 1, 0, 0.5, 1, 0, 1], task=list("aabbbcccc"))
    assert score_of(group) == pytest.approx(aggregate(fill(group))["score"])
    interval = score_interval(group)
    assert interval.ci_method == "bootstrap" and interval.ci_low < score_of(group) < interval.ci_high
    passages = [{"id": i, "score": 0.0, "nll": 30.0 + 5 * i, "scored_tokens": 10 + i, "buckets": [],
                 "meta": {"text": "t"}} for i in range(6)]
    assert score_of(passages) == pytest.approx(perplexity_metrics(passages)["score"])
    interval = score_interval(passages)
    assert interval.ci_low < score_of(passages) < interval.ci_high


def fill(records):
    numbers = ("kept_tokens", "prompt_tokens", "bytes_held", "bytes_ideal", "bytes_full", "attended_fraction",
               "prefill_seconds", "decode_seconds", "new_tokens")
    return [{**{k: 1.0 for k in numbers}, **r} for r in records]


@pytest.mark.parametrize("only_a, only_b, both, neither", [(6, 1, 10, 3), (0, 0, 5, 5), (9, 0, 0, 11), (3, 4, 6, 7)])
def test_binary_runs_are_compared_with_the_exact_mcnemar_test(only_a, only_b, both, neither):
    a = [1] * only_a + [0] * only_b + [1] * both + [0] * neither
    b = [0] * only_a + [1] * only_b + [1] * both + [0] * neither
    result = compare(binary(a), binary(b))
    expected = mcnemar([[both, only_a], [only_b, neither]], exact=True).pvalue
    assert result.p_value == pytest.approx(expected, abs=1e-12)
    if only_a + only_b:
        assert result.p_value == pytest.approx(stats.binomtest(only_a, only_a + only_b).pvalue)
    assert (result.only_a, result.only_b, result.test) == (only_a, only_b, "exact McNemar")
    assert result.difference == pytest.approx((only_a - only_b) / len(a))
    assert result.ci_low <= result.difference <= result.ci_high


def test_a_pass_fail_difference_gets_newcombes_square_and_add_interval():
    """Fagerland, Lydersen and Laake's worked example (Statistical Analysis of Contingency Tables, ch. 8;
    Cavo et al. 2012: 59 pairs both passed, 6 only A, 16 only B, 80 neither): -0.0621, 95 % CI -0.1186 to -0.0046."""
    a = [1] * 59 + [1] * 6 + [0] * 16 + [0] * 80
    b = [1] * 59 + [0] * 6 + [1] * 16 + [0] * 80
    result = compare(binary(a), binary(b))
    assert result.interval == "Newcombe"
    assert [round(x, 4) for x in (result.difference, result.ci_low, result.ci_high)] == [-0.0621, -0.1186, -0.0046]
    same = compare(binary([1] * 20), binary([1] * 20))  # no disagreement: still as wide as 20 samples allow
    assert same.ci_low < 0 < same.ci_high and same.ci_low == pytest.approx(-same.ci_high)


@pytest.mark.parametrize("n", [10, 25])
@pytest.mark.parametrize("probabilities", [(0.4, 0.1, 0.1, 0.4), (0.7, 0.2, 0.05, 0.05), (0.1, 0.3, 0.1, 0.5),
                                           (0.3, 0.0, 0.2, 0.5), (0.05, 0.4, 0.05, 0.5)])
def test_the_pass_fail_interval_covers_the_true_difference_near_95_percent_of_the_time(n, probabilities):
    """Exact coverage: every table of n pairs (both, only A, only B, neither), weighted by its multinomial
    probability. Newcombe's interval covers 0.943-0.989 of the time in these settings; the percentile bootstrap
    evalkit used before covered 0.866-0.907 at n = 10 in four of them (scripts/interval_coverage.py)."""
    truth = probabilities[1] - probabilities[2]
    tables = np.array([(n - x - y - z, x, y, z) for x in range(n + 1) for y in range(n + 1 - x)
                       for z in range(n + 1 - x - y)])
    weights = stats.multinomial.pmf(tables, n, probabilities)
    covered = [low - 1e-12 <= truth <= high + 1e-12 for low, high in itertools.starmap(
        uncertainty._newcombe_interval, tables.tolist())]
    assert weights.sum() == pytest.approx(1) and weights @ covered >= 0.94


def test_continuous_runs_are_compared_with_a_paired_permutation_test():
    rng = np.random.default_rng(2)
    base = rng.uniform(0, 1, 60)
    same = compare(binary(base), binary(base))
    assert same.p_value == 1.0 and same.ci_low == same.ci_high == same.difference == 0
    shifted = compare(binary(np.clip(base + 0.2, 0, 1)), binary(base))
    assert shifted.test == "paired permutation" and shifted.p_value < 0.001 and shifted.ci_low > 0
    assert shifted.verdict("snapkv", "h2o").startswith("snapkv better, p = ")
    noise = compare(binary(np.clip(base + rng.normal(0, 0.02, 60), 0, 1)), binary(base))
    assert noise.p_value > ALPHA and noise.ci_low < 0 < noise.ci_high
    # The paired interval is scipy's Student t interval of the per-sample differences.
    own = stats.ttest_1samp(np.clip(base + 0.2, 0, 1) - base, 0).confidence_interval(0.95)
    assert shifted.interval == "Student t" and (shifted.ci_low, shifted.ci_high) == pytest.approx((own.low, own.high))


def test_the_difference_interval_weighs_samples_as_the_score_does():
    """A group task's t interval is of n x weight x difference (their mean: the difference of the scores); a
    group of equal pass/fail tasks is a pooled share, and gets Newcombe's; perplexity keeps the bootstrap;
    differences all equal give that value; shares' intervals stay within [-1, 1]."""
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 5, 9) / 4, rng.integers(0, 5, 9) / 4
    tasks = ["niah"] * 3 + ["vt"] * 6
    weighted = 9 * np.r_[np.full(3, 1 / 6), np.full(6, 1 / 12)] * (a - b)
    result = compare(binary(a, tasks), binary(b, tasks))
    assert result.difference == pytest.approx(weighted.mean()) and result.interval == "Student t"
    own = stats.ttest_1samp(weighted, 0).confidence_interval(0.95)
    assert (result.ci_low, result.ci_high) == pytest.approx((max(own.low, -1), min(own.high, 1)))
    passed_a, passed_b = rng.integers(0, 2, 20), rng.integers(0, 2, 20)
    pooled = compare(binary(passed_a), binary(passed_b))
    grouped = compare(binary(passed_a, ["niah", "vt"] * 10), binary(passed_b, ["niah", "vt"] * 10))
    assert grouped.interval == pooled.interval == "Newcombe"
    assert (grouped.ci_low, grouped.ci_high) == pytest.approx((pooled.ci_low, pooled.ci_high))
    nll, tokens = rng.uniform(10, 30, (2, 9)), rng.integers(5, 15, (2, 9))
    passages = [[{"id": f"s{i}", "score": float(np.exp(n / t)), "nll": float(n), "scored_tokens": int(t)}
                 for i, (n, t) in enumerate(zip(*run))] for run in zip(nll, tokens)]
    assert compare(*passages).interval == "paired bootstrap"
    ahead = compare(binary([0.5, 0.75, 1.0]), binary([0.25, 0.5, 0.75]))  # every sample a quarter better
    assert (ahead.ci_low, ahead.ci_high) == pytest.approx((0.25, 0.25)) and ahead.p_value == 0.25
    wide = compare(binary([1.0, 0.25]), binary([0.0, 0.5]))  # t with one degree of freedom
    assert (wide.ci_low, wide.ci_high) == (-1.0, 1.0)


def _swapped_p(a: np.ndarray, b: np.ndarray, statistic) -> float:
    """The share of the 2^n swaps of the samples' pairs (the last axis of `a` and `b`), enumerated, whose
    |statistic| is at least the observed one."""
    swaps = itertools.product((False, True), repeat=a.shape[-1])
    swapped = np.array([abs(statistic(np.where(s, b, a), np.where(s, a, b))) for s in map(np.array, swaps)])
    return float(np.mean(swapped >= abs(statistic(a, b)) - 1e-12))


@pytest.mark.parametrize("seed", range(4))
def test_the_permutation_p_value_is_every_swap_of_the_samples_pairs_enumerated(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 5, 9) / 4, rng.integers(0, 5, 9) / 4  # shares of four needles
    assert compare(binary(a), binary(b)).p_value == pytest.approx(_swapped_p(a, b, lambda x, y: x.mean() - y.mean()))
    tasks = ["niah"] * 3 + ["vt"] * 6  # a group task's score: the mean of its tasks' means
    by_task = lambda x, y: np.mean([(x - y)[:3].mean(), (x - y)[3:].mean()])  # noqa: E731
    assert compare(binary(a, tasks), binary(b, tasks)).p_value == pytest.approx(_swapped_p(a, b, by_task))
    a, b = rng.uniform(0, 1, 9), rng.uniform(0, 1, 9)  # an F1 or a ROUGE: on no common step
    assert compare(binary(a), binary(b)).p_value == pytest.approx(_swapped_p(a, b, lambda x, y: x.mean() - y.mean()))
    assert compare(binary(a, tasks), binary(b, tasks)).p_value == pytest.approx(_swapped_p(a, b, by_task))
    nll, tokens = rng.uniform(10, 30, (2, 9)), rng.integers(5, 15, (2, 9))  # a swap moves nll and tokens together
    passages = [[{"id": f"s{i}", "score": float(np.exp(n / t)), "nll": float(n), "scored_tokens": int(t)}
                 for i, (n, t) in enumerate(zip(*run))] for run in zip(nll, tokens)]
    perplexity = lambda x, y: np.exp(x[0].sum() / x[1].sum()) - np.exp(y[0].sum() / y[1].sum())  # noqa: E731
    assert compare(*passages).p_value == pytest.approx(
        _swapped_p(np.stack([nll[0], tokens[0]]), np.stack([nll[1], tokens[1]]), perplexity))


@pytest.mark.slow  # all 2^18 swaps of 18 samples
def test_shares_past_every_swap_get_the_exact_distribution_of_their_sign_flips():
    """Differences on one step (quarters, thirds weighted by 1/n) get an exact p-value at any n: at 18
    samples every swap's, enumerated; at 400 the tail of the sum of sign flips worked out independently (one
    step size: a binomial; three: their binomials convolved), far below what 10,000 random swaps resolve."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 5, 18) / 4, rng.integers(0, 5, 18) / 4
    signs = np.array(list(itertools.product((1, -1), repeat=18)))  # a swap flips a sample's difference
    exact = float(np.mean(np.abs(signs @ (a - b)) >= abs((a - b).sum()) - 1e-12))
    assert compare(binary(a), binary(b)).p_value == pytest.approx(exact, rel=1e-9)
    a = np.r_[np.full(170, 2 / 3), np.full(80, 1 / 3), np.zeros(150)]  # 250 samples differ by a third,
    b = np.r_[np.full(170, 1 / 3), np.full(80, 2 / 3), np.zeros(150)]  # 170 of them in favour of A
    tail = stats.binom.sf(169, 250, 0.5) + stats.binom.cdf(80, 250, 0.5)  # |heads - tails| >= 90
    assert compare(binary(a), binary(b)).p_value == pytest.approx(tail, rel=1e-9) and tail < 1e-7
    a[1:250:2] += 0.25  # in twelfths: steps of 4 (125 samples), 7 (85: +1/3 + 1/4) and -1 (40: -1/3 + 1/4)
    sums = {0: 1.0}  # the sum of the steps' sign flips: P(sum = total), one step size at a time
    for size, count in ((4, 125), (7, 85), (1, 40)):
        merged: dict[int, float] = {}
        for j in range(count + 1):
            for total, p_total in sums.items():
                key = total + size * (2 * j - count)
                merged[key] = merged.get(key, 0.0) + p_total * stats.binom.pmf(j, count, 0.5)
        sums = merged
    observed = round(12 * (a - b).sum())
    assert observed == 85 * 4 + 85 * 7 - 40 * 4 - 40 * 1
    assert compare(binary(a), binary(b)).p_value == pytest.approx(
        sum(p for total, p in sums.items() if abs(total) >= abs(observed)), rel=1e-9)


def test_differences_are_put_on_one_step_only_where_they_all_sit_on_it():
    assert list(_on_one_step(np.array([1 / 3, -2 / 3, 1.0]) / 25)) == [1, -2, 3]  # thirds over 25 samples
    assert list(_on_one_step(np.array([0.1 + 0.2, -0.3]))) == [3, -3]  # tenths: float noise is not a step
    assert _on_one_step(np.array([0.25 + 1e-9, 0.5])) is None
    group = np.r_[np.full(997, 0.25 / (2 * 997)), np.full(1009, 0.25 / (2 * 1009))]  # two tasks' means
    assert _on_one_step(group) is None  # their common step, 1 / (8 * 997 * 1009), is finer than 1 / FINEST_STEP


def test_the_exact_p_value_is_1_at_no_difference_and_never_0():
    for seed in range(20):  # sums of 1,280 quarters in different orders: ties, not larger, however they round
        quarters = np.random.default_rng(seed).integers(0, 5, 1280) / 4
        assert compare(binary(quarters), binary(np.random.default_rng(seed + 99).permutation(quarters))).p_value == 1.0
    far = compare(binary(np.full(1200, 0.75)), binary(np.full(1200, 0.5)), detect=None)
    assert 0 < far.p_value < 1e-300  # 2 / 2^1200 is below the smallest float


def test_a_distribution_too_long_to_hold_falls_back_to_random_swaps(monkeypatch):
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 5, 18) / 4, rng.integers(0, 5, 18) / 4
    exact = compare(binary(a), binary(b)).p_value
    monkeypatch.setattr(uncertainty, "LONGEST_DISTRIBUTION", 8)
    sampled = compare(binary(a), binary(b)).p_value
    assert sampled * (RESAMPLES + 1) == pytest.approx(round(sampled * (RESAMPLES + 1)))
    assert abs(sampled - exact) <= 4 * np.sqrt(exact * (1 - exact) / RESAMPLES) + 1 / RESAMPLES


def test_scores_on_no_common_step_past_every_swap_get_10000_random_swaps_plus_one():
    """At 18 samples (2^18 swaps) of scores on no common step (an F1, a ROUGE) the test draws RESAMPLES
    swaps: its p-value, (count + 1) / (RESAMPLES + 1), lies within sampling error of every swap's p-value."""
    rng = np.random.default_rng(5)
    a, b = rng.uniform(0, 1, 18), rng.uniform(0, 1, 18)
    signs = np.array(list(itertools.product((1, -1), repeat=18)))
    exact = float(np.mean(np.abs(signs @ (a - b)) >= abs((a - b).sum()) - 1e-12))
    sampled = compare(binary(a), binary(b)).p_value
    assert abs(sampled - exact) <= 4 * np.sqrt(exact * (1 - exact) / RESAMPLES) + 1 / RESAMPLES
    assert sampled * (RESAMPLES + 1) == pytest.approx(round(sampled * (RESAMPLES + 1)))


@pytest.mark.parametrize("n", [6, 10, 25])
def test_two_runs_that_differ_by_chance_only_are_called_different_at_most_alpha_of_the_time(n):
    """Under the null hypothesis (two runs whose results on a sample are exchangeable) the test rejects at
    most ALPHA of the time, but for the trials' own chance (a 1 % bound of the binomial)."""
    rng = np.random.default_rng(n)
    rejected = 0
    trials = 200
    for _ in range(trials):
        quality = rng.uniform(0, 1, n)
        a, b = (np.round(np.clip(quality + rng.normal(0, 0.3, (2, n)), 0, 1) * 4) / 4)
        rejected += compare(binary(a), binary(b)).p_value < ALPHA
    assert rejected <= stats.binom.ppf(0.99, trials, ALPHA)


def test_the_verdict_says_what_was_found_and_what_it_would_take():
    a = binary([1] * 3 + [0] * 17)
    b = binary([0] * 1 + [1] * 2 + [0] * 16 + [1])
    result = compare(a, b)
    assert not result.significant
    assert result.verdict() == (f"no difference detected at n = 20 (p = {result.p_value:.3g}); would need "
                                f"≈ {result.needed} samples to detect a 10-point difference")
    assert compare(binary([1] * 12 + [0] * 8), binary([0] * 20)).verdict() == "A better, p = 0.000488"
    # Two samples, both lost: Newcombe's interval excludes 0, the exact test cannot reject; the verdict says which
    tiny = compare(binary([0, 0]), binary([1, 1]), detect=None)
    assert tiny.ci_high < 0 and not tiny.significant and tiny.interval_disagrees
    assert tiny.verdict() == ("no difference detected at n = 2 (p = 0.5); the interval, an approximation, "
                              "disagrees at this n: the test decides")
    assert not compare(binary([1] * 12 + [0] * 8), binary([0] * 20)).interval_disagrees


def test_samples_needed_gives_the_exact_mcnemar_test_its_power():
    n = samples_needed(0.10, discordance=0.3)
    assert _mcnemar_power(n, 0.3, (0.3 + 0.1) / 0.6) >= 0.8
    # The smallest such n: no fewer samples reach the power (a search by steps of n // 64 overshot by up to 8).
    for detect, discordance in [(0.10, 0.3), (0.20, 0.5), (0.05, 0.1), (0.15, 0.15)]:
        needed, toward_a = samples_needed(detect, discordance), (discordance + detect) / (2 * discordance)
        powers = [_mcnemar_power(k, discordance, toward_a) for k in range(1, needed + 1)]
        assert powers[-1] >= 0.8 > max(powers[:-1]), (detect, discordance)
    # A simulation agrees: pairs drawn at that disagreement, tested with scipy's exact binomial test.
    rng = np.random.default_rng(3)
    disagreements = rng.binomial(n, 0.3, 1000)
    wins = rng.binomial(disagreements, (0.3 + 0.1) / 0.6)
    power = np.mean([stats.binomtest(k, m).pvalue < ALPHA if m else False for k, m in zip(wins, disagreements)])
    assert power == pytest.approx(0.8, abs=0.04)
    # Connor's normal approximation is close; more disagreement or a smaller difference needs more samples.
    z_a, z_b = stats.norm.ppf(1 - ALPHA / 2), stats.norm.ppf(0.8)
    assert n == pytest.approx((z_a * 0.3 ** 0.5 + z_b * (0.3 - 0.01) ** 0.5) ** 2 / 0.01, rel=0.1)
    assert samples_needed(0.10) > n > samples_needed(0.20, discordance=0.3)
    assert samples_needed(0.10, difference_sd=0.3) == int(np.ceil(((z_a + z_b) * 0.3 / 0.1) ** 2))


def test_bad_comparisons_are_refused_in_one_line():
    with pytest.raises(EvalkitError, match="different samples"):
        compare(binary([1, 0]), binary([1, 0, 1]))
    with pytest.raises(EvalkitError, match="different samples"):
        compare(binary([1, 0]), [{"id": "other", "score": 1.0}, {"id": "s1", "score": 0.0}])
    with pytest.raises(EvalkitError, match="different samples"):
        compare([], [])
    with pytest.raises(EvalkitError, match="at least two"):
        compare(binary([0.5]), binary([0.2]))
    with pytest.raises(EvalkitError, match="no finite score"):
        compare(binary([0.5, float("nan")]), binary([0.2, 0.3]))
    with pytest.raises(EvalkitError, match="difference to detect"):
        samples_needed(0)


# p-values as the tests give them: ties (1.0 for a comparison that cannot be made, equal exact p's) and tiny ones.
_P_VALUES = st.lists(st.one_of(st.sampled_from([1.0, 0.5, 1e-4]), st.floats(0, 1), st.floats(1e-20, 1e-3)),
                     min_size=1, max_size=40)


@given(_P_VALUES)
def test_holm_gives_statsmodels_adjusted_p_values_in_the_order_given(p_values):
    with mock.patch("gc.collect"):  # statsmodels' Holm collects garbage on every call (evalkit.uncertainty.holm)
        expected = list(multipletests(p_values, method="holm")[1])
    assert holm(p_values) == pytest.approx(expected, rel=1e-12, abs=0)
