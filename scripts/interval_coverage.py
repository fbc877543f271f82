"""How often the interval of a paired difference (`evalkit compare`) covers the true difference, against the
percentile bootstrap evalkit used before (docs/statistics.md).

    python scripts/interval_coverage.py            # both tables, under a minute on one core

Pass/fail pairs: exact coverage, every table of n pairs (both passed, only A, only B, neither) weighed by its
multinomial probability; Newcombe's interval as `compare` computes it, the bootstrap with scipy (1,000
resamples a table). Shares of four needles: simulated runs whose samples share a difficulty (so the two runs'
scores correlate), `compare`'s Student t interval and scipy's percentile bootstrap on the same draws.
"""

from __future__ import annotations

import numpy as np
from scipy import integrate, stats

from evalkit.uncertainty import compare
from evalkit.uncertainty.intervals import _newcombe_interval

PASS_FAIL = [(0.4, 0.1, 0.1, 0.4), (0.7, 0.2, 0.05, 0.05), (0.1, 0.3, 0.1, 0.5), (0.3, 0.0, 0.2, 0.5),
             (0.05, 0.4, 0.05, 0.5)]  # (both, only A, only B, neither)
SHARES = [(0.4, 0.4, 0.8), (0.3, 0.1, 0.8), (0.9, 0.8, 0.5), (0.5, 0.3, 0.3)]  # (A finds, B finds, shared difficulty)
NEEDLES, RUNS, RESAMPLES = 4, 1_000, 2_000


def bootstrap_covers(differences: np.ndarray, truth: float, rng, resamples: int) -> bool:
    if np.all(differences == differences[0]):
        return bool(differences[0] == truth)
    interval = stats.bootstrap((differences,), np.mean, n_resamples=resamples, method="percentile",
                               rng=rng).confidence_interval
    return bool(interval.low <= truth <= interval.high)


def pass_fail(n: int, probabilities: tuple, with_bootstrap: bool) -> tuple[float, float | None]:
    truth = probabilities[1] - probabilities[2]
    rng = np.random.default_rng(0)
    tables = [(n - x - y - z, x, y, z) for x in range(n + 1) for y in range(n + 1 - x) for z in range(n + 1 - x - y)]
    weights = stats.multinomial.pmf(tables, n, probabilities)
    newcombe = sum(weight * (low - 1e-12 <= truth <= high + 1e-12)
                   for weight, (low, high) in zip(weights, (_newcombe_interval(*table) for table in tables)))
    if not with_bootstrap:
        return newcombe, None
    bootstrap = sum(weight * bootstrap_covers(np.r_[np.zeros(both + neither), np.ones(only_a), -np.ones(only_b)],
                                              truth, rng, 1_000)
                    for weight, (both, only_a, only_b, neither) in zip(weights, tables))
    return newcombe, bootstrap


def shares(n: int, finds_a: float, finds_b: float, shared: float, rng) -> np.ndarray:
    """[2, n] shares of NEEDLES found: a needle is found where its draw, part shared by the sample, is below
    the run's rate."""
    difficulty = rng.random((n, 1))
    draws = rng.random((2, n, NEEDLES)) * (1 - shared) + difficulty * shared
    return (draws < np.array([finds_a, finds_b])[:, None, None]).mean(-1)


def found(rate: float, shared: float) -> float:
    """P(draw < rate), draw = (1 - shared) U + shared D with U, D uniform: the expected share `shares` gives."""
    return integrate.quad(lambda d: np.clip((rate - shared * d) / (1 - shared), 0, 1), 0, 1)[0]


def shares_coverage(n: int, setting: tuple) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    truth = found(setting[0], setting[2]) - found(setting[1], setting[2])
    t_hits = bootstrap_hits = 0
    for _ in range(RUNS):
        a, b = shares(n, *setting, rng)
        records = [[{"id": i, "score": float(s)} for i, s in enumerate(run)] for run in (a, b)]
        result = compare(*records, detect=None)
        t_hits += result.ci_low - 1e-12 <= truth <= result.ci_high + 1e-12
        bootstrap_hits += bootstrap_covers(a - b, truth, rng, RESAMPLES)
    return t_hits / RUNS, bootstrap_hits / RUNS


def main() -> None:
    print("pass/fail pairs, exact coverage of a 95 % interval\n")
    print("| n | both, only A, only B, neither | Newcombe | percentile bootstrap |\n|---:|---|---:|---:|")
    for n in (10, 25):
        for probabilities in PASS_FAIL:
            newcombe, bootstrap = pass_fail(n, probabilities, with_bootstrap=n == 10)
            shown = "–" if bootstrap is None else f"{bootstrap:.3f}"
            print(f"| {n} | {', '.join(map(str, probabilities))} | {newcombe:.3f} | {shown} |", flush=True)
    print(f"\nshares of {NEEDLES} needles, coverage over {RUNS} simulated pairs of runs\n")
    print("| n | A finds, B finds, shared difficulty | Student t | percentile bootstrap |\n|---:|---|---:|---:|")
    for n in (10, 25):
        for setting in SHARES:
            t, bootstrap = shares_coverage(n, setting)
            print(f"| {n} | {', '.join(map(str, setting))} | {t:.3f} | {bootstrap:.3f} |", flush=True)


if __name__ == "__main__":
    main()
