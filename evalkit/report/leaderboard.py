"""The leaderboard's numbers: the quality AUC (its headline), one row per run, how a value is shown, the CSV.

Area under the quality-vs-budget curve (the headline number): with x the budget as a fraction
of the prompt (a token budget counts as budget / mean prompt tokens, at most 1) and y the
score, the trapezoid integral of the series' points over [x_lo, 1] divided by (1 - x_lo),
where x_lo is the smallest budget any series of the setting was run at. A series without a
run at budget 1 ends at the full-cache score there (budget 1 keeps every token). So the AUC
is the mean score over the budget range, in score units; a series with no run at x_lo gets
none, since its area would not be comparable.

The runs come in as `evalkit.report.page.Entry`s, already placed in their setting and series.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

AUC_DEFINITION = (
    "AUC: the area under a policy's quality-vs-budget curve (budget as a fraction of the prompt; a token budget "
    "counts as budget / mean prompt tokens), trapezoids over [lowest budget of the task, 1], divided by the width "
    "of that range, so it is the policy's mean score over the budgets. A policy without a run at budget 1 ends at "
    "the full-cache score there; a policy not run at the task's lowest budget has no AUC. AUC / full divides by "
    "the full-cache score.")

AUC_SHORT = "AUC / full: the mean relative score over the budgets (trapezoids over the view's lowest budget to 1)."

COLUMNS = [  # the page's run table: (heading, key in a row, display format); the AUC is the headline
    ("task", "setting", "text"), ("policy", "series", "text"), ("budget", "budget", "budget"),
    ("metric", "metric", "text"), ("AUC", "auc", "score"), ("AUC / full", "relative_auc", "pct"),
    ("score", "score", "score"), ("95% CI", "ci", "ci"),
    ("score / full", "relative_score", "pct"), ("significant", "significance", "text"),
    ("KV held MiB", "mib_held", "num1"), ("KV held / full", "held_over_full", "pct"),
    ("held / ideal", "held_over_ideal", "num3"),
    ("samples", "samples", "num0"), ("run", "run_id", "text"),
]  # the tokens per second are in the CSV
_CSV_COLUMNS = ["task", "length", "setting", "policy", "series", "budget", "budget_fraction", "auc", "relative_auc",
                "score", "ci_low", "ci_high", "relative_score", "full_cache_score", "p_vs_full", "significance",
                "bytes_held", "held_over_full", "held_over_ideal", "new_tokens", "new_tokens_over_full",
                "prefill_tokens_per_s", "decode_tokens_per_s", "samples", "run_id"]


def quality_auc(points: list[tuple[float, float]], start: float, full_score: float | None) -> float | None:
    """Normalised area under (budget fraction, score) over [start, 1]; see the module docstring."""
    points = sorted(points)
    if full_score is not None and not any(math.isclose(x, 1.0) for x, _ in points):
        points.append((1.0, full_score))
    if not points or not math.isclose(points[0][0], start) or not math.isclose(points[-1][0], 1.0):
        return None
    if math.isclose(start, 1.0):
        return points[-1][1]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    return area / (1.0 - start)


def leaderboard_rows(entries: list) -> list[dict]:
    """One row per placed entry (`page.Entry`), best first within each setting."""
    rows = []
    for e in entries:
        m = e.metrics
        rows.append({
            "setting": e.setting, "task": e.config.get("task"), "length": e.config.get("length"),
            "series": e.series, "policy": e.config["policy"], "budget": e.config["budget"], "budget_fraction": e.x,
            "metric": m.get("metric") if m.get("higher_is_better") is False else "score %",
            "lower_is_better": m.get("higher_is_better") is False,
            "auc": e.auc, "relative_auc": e.relative(e.auc), "score": m["score"],
            "relative_score": e.relative(m["score"]), "full_cache_score": e.baseline["score"] if e.baseline else None,
            "bytes_held": m.get("bytes_held"), "mib_held": m["bytes_held"] / 2**20 if "bytes_held" in m else None,
            "held_over_full": m.get("held_over_full"), "held_over_ideal": m.get("held_over_ideal"),
            "prefill_tokens_per_s": m.get("prefill_tokens_per_s"),
            "decode_tokens_per_s": m.get("decode_tokens_per_s"), "samples": m.get("samples"), "run_id": e.run_id,
            **_answer_lengths(e), **_uncertainty(e),
        })
    def rank(r):  # best first: the highest AUC, or the lowest where lower is better (perplexity)
        auc = r["auc"] if r["auc"] is not None else (math.inf if r["lower_is_better"] else -math.inf)
        return auc if r["lower_is_better"] else -auc

    return sorted(rows, key=lambda r: (r["setting"], rank(r), r["series"], r["budget_fraction"]))


def _answer_lengths(e) -> dict:
    """Mean new tokens a sample, and their total over the full cache's on the samples both ran (eviction can
    lengthen answers, or make them loop: docs/tasks.md, long answers)."""
    mine = {r["id"]: r["new_tokens"] for r in e.records if "new_tokens" in r}
    if not mine:
        return {}
    full = {r["id"]: r["new_tokens"] for r in e.baseline_entry.records if "new_tokens" in r} if e.baseline_entry else {}
    both = mine.keys() & full.keys()
    full_total = sum(full[i] for i in both)
    return {"new_tokens": sum(mine.values()) / len(mine),
            "new_tokens_over_full": sum(mine[i] for i in both) / full_total if full_total else None}


def _uncertainty(e) -> dict:
    """The run's 95 % interval and its paired tests (docs/statistics.md)."""
    interval, marks = e.interval, e.marks
    low, high = (interval.ci_low, interval.ci_high) if interval else (None, None)
    lower_is_better = e.metrics.get("higher_is_better") is False
    return {"ci_low": low, "ci_high": high, "ci": (low, high) if low is not None else None,
            "p_vs_full": marks.vs_full.p_value if marks and marks.vs_full else None,
            "significance": marks.text(lower_is_better) if marks else None}


def display(value, kind: str, lower_is_better: bool = False) -> tuple[str, str]:
    """(text shown, value sorted on): numbers sort numerically, a missing value shows as a dash. A score is a
    fraction shown in percent, or a perplexity (lower is better) shown as it is; an interval as low–high."""
    if value is None:
        return "—", ""
    if kind == "ci":
        low, high = (display(bound, "score", lower_is_better)[0] for bound in value)
        return f"{low}–{high}", repr(float(value[0]))
    if kind == "score":
        kind = "num2" if lower_is_better else "pct"
    if kind == "text":
        return str(value), str(value)
    if kind == "pct":
        return f"{100 * value:.1f}", repr(float(value))
    if kind == "budget":
        return str(value), repr(float(value))
    digits = {"num0": 0, "num1": 1, "num2": 2, "num3": 3}[kind]
    return f"{value:.{digits}f}", repr(float(value))


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, _CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def is_number(value) -> bool:
    """A finite int or float (bools are not numbers here; an int too big for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
