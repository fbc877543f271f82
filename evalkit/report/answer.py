"""The answer the report opens on: quality relative to the full cache against budget, averaged over the tasks a
model can do, per model × length × query mode, one line per series (a scorer at a granularity, with any other
way of running it); and the compact leaderboard under it, one row per series.

Glossary (the page says the same):
- *view*: a model, a length and a query mode (question seen or unseen while compressing);
- *tasks it can do*: those whose full cache scores at least `CAN_DO` there; the others say nothing about a
  policy (a model that fails with every token kept fails with fewer) and are left out of the averages;
- *relative score*: a run's score over its full cache's on the same samples;
- a point: the mean relative score over the view's tasks that the series ran at that budget, its error bar
  the mean's 95 % half-width from the runs' own intervals, taken as independent across tasks:
  sqrt(sum of (half-width / full)^2) / tasks;
- *AUC / full*: `leaderboard.quality_auc` over those points (the full cache is 1 at budget 1);
- *wins / losses*: the series' runs' paired tests against the same scorer at other granularities (Holm-adjusted
  within scorer × budget × task, `report.significance`) that found it better / worse.

The runs come in as `page.Entry`s, placed and tested; only higher-is-better scores take part (perplexity runs
have no relative score to average).
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict

from evalkit.errors import EvalkitError
from evalkit.policies import make_policy
from evalkit.policies.names import policy_family, policy_label
from evalkit.report.leaderboard import quality_auc

CAN_DO = 1 / 3  # the full cache's score from which a task counts for a model


def answer_data(entries: list) -> dict:
    """{"points": [...], "rows": [...], "can_do": CAN_DO}: what the page's answer plot and compact leaderboard draw,
    plain JSON (the page filters it in the browser)."""
    counted = [e for e in entries if _counts(e)]
    by_view_series: dict[tuple, list] = defaultdict(list)
    for e in counted:
        by_view_series[(*view_of(e), line_label(e))].append(e)
    starts: dict[tuple, float] = {}
    for (model, length, mode, _), members in by_view_series.items():
        low = min(e.x for e in members)
        starts[(model, length, mode)] = min(starts.get((model, length, mode), low), low)
    points, rows = [], []
    for (model, length, mode, series), members in sorted(by_view_series.items(), key=lambda item: str(item[0])):
        scorer, granularity = family_of(members[0])
        line = _points(members)
        view = {"model": model, "length": length, "mode": mode, "series": series, "scorer": scorer,
                "granularity": granularity, "plain": series == policy_name(members[0].config)}
        points += [{**view, **point} for point in line]
        auc = quality_auc([(p["x"], p["relative"]) for p in line], starts[(model, length, mode)], 1.0)
        wins, losses = _record(members)
        rows.append({**view, "auc": auc, "tasks": _tasks(members), "wins": wins, "losses": losses,
                     "budgets": {_budget(p["budget"]): {"relative": p["relative"], "held_over_full": p["held_over_full"]}
                                 for p in line}})
    return {"points": points, "rows": rows, "can_do": CAN_DO}


GRANULARITIES = ("head", "head_page", "token", "page")  # the headline's lines, in its legend's order


def headline(data: dict) -> dict[tuple, dict]:
    """Per view: the granularities most of its scorers were run at plainly (no other variant; all four where
    any scorer was, two on a model with one KV head), the scorers run at all of them, and per granularity its
    relative score at each budget they all ran, averaged over those scorers (each its mean over its tasks).
    A scorer whose per-head budget is pooled over layers (KVzip) is left out: its lines would change the pooling
    with the unit. {view: {"scorers": [...], "budgets": [...], "lines": {granularity: [relative, ...]}}}; views
    with no two granularities to compare are left out."""
    by_view: dict[tuple, dict] = defaultdict(dict)
    for p in data["points"]:
        if p["plain"] and p["granularity"] in GRANULARITIES and not _pools_per_head(p["scorer"]):
            by_view[(p["model"], p["length"], p["mode"])][p["scorer"], p["granularity"], p["budget"]] = p["relative"]
    found = {}
    for view, relative in sorted(by_view.items(), key=lambda item: str(item[0])):
        ran = {s: frozenset(g for t, g, _ in relative if t == s) for s, _, _ in relative}
        compared = max(set(ran.values()), key=lambda gs: (len(gs), sum(gs <= other for other in ran.values())))
        scorers = sorted(s for s, gs in ran.items() if compared <= gs)
        lines = [g for g in GRANULARITIES if g in compared]
        budgets = sorted({b for s, _, b in relative if s in scorers}, key=float)
        budgets = [b for b in budgets if all((s, g, b) in relative for s in scorers for g in lines)]
        if len(lines) > 1 and budgets:
            found[view] = {"scorers": scorers, "budgets": budgets,
                           "lines": {g: [sum(relative[s, g, b] for s in scorers) / len(scorers) for b in budgets]
                                     for g in lines}}
    return found


@functools.cache  # asked once per point of the page
def _pools_per_head(scorer: str) -> bool:
    try:
        return make_policy(scorer, "head").selects_across_layers
    except EvalkitError:  # a scorer this evalkit does not know, or one that refuses head granularity
        return False


def line_label(e) -> str:
    """The run's series without its query mode, which the view names already."""
    variant = ", ".join(f"{k}={as_text(v)}" for k, v in e.variant.items() if k != "query_aware")
    return policy_name(e.config) + (f" ({variant})" if variant else "")


def policy_name(config: dict) -> str:
    """The policy that ran, granularity included (a run folder of any evalkit version)."""
    try:
        return policy_label(config["policy"], config.get("granularity"))
    except EvalkitError:  # a policy this evalkit does not know: its name as stored
        return str(config["policy"])


def as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def view_of(e) -> tuple[str, object, str]:
    """(model, length, query mode) of a run."""
    mode = "question unseen" if e.config.get("query_aware") is False else "question seen"
    return str(e.config.get("model")), e.config.get("length"), mode


def _counts(e) -> bool:
    """A policy's run on a task its model can do, with a score relative to its full cache."""
    if e.is_full or not e.baseline or e.metrics.get("higher_is_better") is False:
        return False
    full = e.baseline.get("score")
    return isinstance(full, (int, float)) and full >= CAN_DO and math.isfinite(e.metrics["score"])


def family_of(e) -> tuple[str, str]:
    """(scorer, granularity) of what a run ran."""
    try:
        scorer, granularity = policy_family(e.config["policy"], e.config.get("granularity"))
        return scorer, granularity.value
    except EvalkitError:  # a policy this evalkit does not know: its name, at no known granularity
        return str(e.config["policy"]), "-"


def _points(members: list) -> list[dict]:
    """One point per budget: the mean relative score over the tasks run there, its error bar, KV held / full."""
    by_budget: dict[float, list] = defaultdict(list)
    for e in members:
        by_budget[e.config["budget"]].append(e)
    line = []
    for budget, runs in sorted(by_budget.items(), key=lambda item: min(e.x for e in item[1])):
        fulls = [e.baseline["score"] for e in runs]
        relative = [e.metrics["score"] / full for e, full in zip(runs, fulls)]
        half_widths = [(e.interval.ci_high - e.interval.ci_low) / 2 / full for e, full in zip(runs, fulls)
                       if e.interval is not None and e.interval.ci_low is not None]
        held = [e.metrics["held_over_full"] for e in runs if isinstance(e.metrics.get("held_over_full"), (int, float))]
        line.append({"budget": budget, "x": sum(e.x for e in runs) / len(runs),
                     "relative": sum(relative) / len(relative),
                     "error": math.sqrt(sum(h * h for h in half_widths)) / len(runs)
                     if len(half_widths) == len(runs) else None,
                     "held_over_full": sum(held) / len(held) if held else None,
                     "tasks": sorted(str(e.config.get("task")) for e in runs)})
    return line


def _tasks(members: list) -> list[dict]:
    """Per task: its full cache's score and the series' relative score at each budget (the row's details)."""
    by_task: dict[str, list] = defaultdict(list)
    for e in members:
        by_task[str(e.config.get("task"))].append(e)
    return [{"task": task, "full": runs[0].baseline["score"],
             "relative": {_budget(e.config["budget"]): e.metrics["score"] / e.baseline["score"] for e in runs}}
            for task, runs in sorted(by_task.items())]


def _record(members: list) -> tuple[int, int]:
    """Significant paired tests against the scorer's other granularities, won and lost."""
    tests = [t for e in members if e.marks for t in e.marks.vs_granularities if t.significant]
    return sum(t.difference > 0 for t in tests), sum(t.difference < 0 for t in tests)


def _budget(budget) -> str:
    """A budget as a JSON key: 0.2 -> "0.2", 64 -> "64"."""
    return repr(budget) if isinstance(budget, float) else str(budget)
