"""The granularity study's tables and plots (docs/granularity.md), read from the run folders the study's sweeps wrote.

    python scripts/granularity_tables.py runs/granularity runs/granularity-query-agnostic runs/study
    python scripts/granularity_tables.py runs/study --summary-only                  # the summary table alone
    python scripts/granularity_tables.py runs/study --summary-only --plots report/granularity   # + one PNG a family

Runs are grouped by setting: model, prompt length, task and query mode (block 16 only). A run still going is
shown with the samples it has finished; one that has finished none is left out. A setting whose full cache
scores below FULL_CACHE_FLOOR is marked (⚠): the model cannot do that task even without eviction, so what
the policies score there says nothing about eviction.

Printed in order:
- the summary: per task family (TASK_FAMILIES), task, length, model, query mode, scorer and budget, the
  full cache's and the four granularities' scores, the three paired comparisons that answer the study's
  question (head_page − head, head_page − page, head_page − token) and the verdict of per-head pages
  against per-head tokens (a win or a loss only where significant);
- per setting: score per policy (scorer x granularity) and budget with its 95 % interval, then per cell
  the KV held over the full cache, held over ideal (tokens kept), and the prefill compression time;
- per setting, the paired tests (`paired_tests`; the summary shows the same numbers): each granularity
  against each other one of the same scorer and budget, and each against the full cache, on the samples
  both runs finished: exact McNemar for pass/fail scores (a paired bootstrap where scores are fractions,
  as `evalkit.uncertainty.compare` chooses), Holm-adjusted within a scorer x budget as `evalkit report`
  does;
- the block-size slice, where the folders hold more than one block size.
A cell of a shared-prefill sweep records the shared forward plus its own compression as `prefill_seconds`;
the full cache's cell of the same sample shares the forward and compresses nothing, so the difference,
averaged over samples, is the compression's time (plus the fork's noise).

`--plots DIR` writes, per task family, model, length and query mode,
`granularity-<family>-<model>-<length>-<mode>.png`: one panel per scorer, the family's score against the
budget, one line per granularity, pooled over the family's tasks (the mean over their samples) with the
pooled samples' 95 % interval (`score_interval`: Wilson for pass/fail scores), and the full cache dashed.
Tasks whose full cache scores below FULL_CACHE_FLOOR are left out (the title names them); a point is drawn
only where every task kept has the cell, so the lines always average the same tasks.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from statsmodels.stats.multitest import multipletests

from evalkit.results import RunDir
from evalkit.uncertainty import ALPHA, Comparison, compare, score_interval

STUDY_BLOCK_SIZE = 16  # the study's block; other sizes are the block-size slice's (`block_table`)
# A full cache scoring below this fails the task by itself: there eviction has little left to lose, and
# differences between policies are noise around the model's failure, not eviction results.
FULL_CACHE_FLOOR = 0.5
FULL_CACHE_WARNING = "⚠ the model cannot do this task with a full cache: differences here are not eviction results"

TASK_FAMILIES = {
    "single needle": ("ruler:niah_single_1", "ruler:niah_single_2", "ruler:niah_single_3"),
    "multi-key needle": ("ruler:niah_multikey_1", "ruler:niah_multikey_2", "ruler:niah_multikey_3"),
    "multi-value/multi-query needle": ("ruler:niah_multivalue", "ruler:niah_multiquery"),
    "tracing": ("ruler:vt",),
    "aggregation": ("ruler:cwe", "ruler:fwe"),
    "QA": ("ruler:qa_1", "ruler:qa_2"),
}
OTHER_FAMILY = "other"

GRANULARITY_ORDER = ("head", "head_page", "token", "page")
PAIRS = (("head_page", "head"), ("head_page", "token"), ("page", "token"), ("head_page", "page"), ("head", "token"),
         ("page", "head"))
# One Holm family per scorer x budget: the granularity pairs and each granularity against the full cache.
COMPARISONS = PAIRS + tuple((granularity, "full") for granularity in GRANULARITY_ORDER)
# The study's question: per-head pages against per-head tokens, against shared pages, and pages against tokens.
SUMMARY_PAIRS = (("head_page", "head"), ("head_page", "page"), ("head_page", "token"))


def load(folders: list[str]) -> list[dict]:
    """Every run folder with at least one finished sample; one still running (no metrics.json yet) is
    summarised from its finished samples."""
    runs = []
    for folder in folders:
        for predictions in sorted(Path(folder).glob("*/predictions.jsonl")):
            run = predictions.parent
            records = RunDir(folder, run.name).predictions()  # skips a last line still being written
            if not records:
                continue
            config = json.loads((run / "config.json").read_text())["config"]
            if (run / "metrics.json").exists():
                metrics = json.loads((run / "metrics.json").read_text())
            else:
                held, full, ideal = (sum(r[k] for r in records) for k in ("bytes_held", "bytes_full", "bytes_ideal"))
                metrics = {"samples": len(records), "score": sum(r["score"] for r in records) / len(records),
                           "held_over_full": held / full, "held_over_ideal": held / ideal}
            runs.append({"config": config, "metrics": metrics, "records": records,
                         "prefill": {r["id"]: r["prefill_seconds"] for r in records}})
    return runs


def split_policy(policy: str) -> tuple[str, str | None]:
    """(scorer, granularity) of a `<scorer>_<granularity>` preset; (policy, None) for any other policy."""
    for granularity in sorted(GRANULARITY_ORDER, key=len, reverse=True):  # `_head_page` before `_page`
        if policy.endswith(f"_{granularity}"):
            return policy[: -len(granularity) - 1], granularity
    return policy, None


def family_of(task: str) -> str:
    return next((family for family, tasks in TASK_FAMILIES.items() if task in tasks), OTHER_FAMILY)


class Setting(NamedTuple):
    model: str
    length: int
    task: str
    query_aware: bool

    @classmethod
    def of(cls, run: dict) -> Setting:
        config = run["config"]
        return cls(config["model"], config["length"], config["task"], config["query_aware"])

    @property
    def mode(self) -> str:
        return "query-aware" if self.query_aware else "query-agnostic"

    def __str__(self) -> str:
        return f"{self.task}, {self.length:,} tokens, {self.model}, {self.mode}"


@dataclass(frozen=True)
class Paired:
    difference: float  # score of the first run minus the second's on their shared samples, a fraction
    p_value: float  # Holm-adjusted within the scorer x budget's COMPARISONS

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA

    def __str__(self) -> str:
        text = f"{100 * self.difference:+.0f} (p = {self.p_value:.2g})"
        return f"**{text}**" if self.significant else text


@dataclass
class SettingRuns:
    setting: Setting
    full: dict | None
    cells: list[dict]  # every run but the full cache's

    @property
    def cannot_do_task(self) -> bool:
        return self.full is not None and self.full["metrics"]["score"] < FULL_CACHE_FLOOR

    def full_cache_note(self) -> str:
        score = f"full cache: {100 * self.full['metrics']['score']:.0f}"
        return f"{score} — {FULL_CACHE_WARNING}" if self.cannot_do_task else score

    def cell(self, scorer: str, granularity: str, budget: float) -> dict | None:
        return self._by_policy_and_budget.get((f"{scorer}_{granularity}", budget))

    @functools.cached_property
    def _by_policy_and_budget(self) -> dict[tuple[str, float], dict]:
        return {(r["config"]["policy"], r["config"]["budget"]): r for r in self.cells}

    @property
    def budgets(self) -> list[float]:
        return sorted({r["config"]["budget"] for r in self.cells})

    @property
    def scorers(self) -> list[str]:
        return sorted({scorer for scorer, granularity in (split_policy(r["config"]["policy"]) for r in self.cells)
                       if granularity is not None})

    @functools.cached_property  # the summary and the paired tables show the same tests: run them once
    def paired(self) -> dict[tuple[str, float], dict[tuple[str, str], Paired | None]]:
        """Per (scorer, budget), every pair of COMPARISONS, Holm-adjusted together; None where a run is
        missing or the two share fewer than two finished samples."""
        tests = {}
        for scorer in self.scorers:
            for budget in self.budgets:
                runs = {g: self.cell(scorer, g, budget) for g in GRANULARITY_ORDER} | {"full": self.full}
                results = {pair: _compare_shared(runs[pair[0]], runs[pair[1]]) for pair in COMPARISONS}
                done = [pair for pair, result in results.items() if result is not None]
                adjusted = multipletests([results[pair].p_value for pair in done], method="holm")[1] if done else []
                holm = dict(zip(done, adjusted))
                tests[scorer, budget] = {pair: Paired(results[pair].difference, float(holm[pair])) if pair in holm
                                         else None for pair in COMPARISONS}
        return tests


def _compare_shared(a: dict | None, b: dict | None) -> Comparison | None:
    """`compare` on the samples both runs finished (a run still going has fewer than the other)."""
    if a is None or b is None:
        return None
    shared = {r["id"] for r in a["records"]} & {r["id"] for r in b["records"]}
    if len(shared) < 2:
        return None
    return compare([r for r in a["records"] if r["id"] in shared], [r for r in b["records"] if r["id"] in shared],
                   detect=None)


def group(runs: list[dict]) -> list[SettingRuns]:
    """The study's runs (block STUDY_BLOCK_SIZE) by setting: query-aware first, then by model, length, task."""
    by_setting: dict[Setting, list[dict]] = {}
    for run in runs:
        if run["config"]["block_size"] == STUDY_BLOCK_SIZE:
            by_setting.setdefault(Setting.of(run), []).append(run)
    order = sorted(by_setting, key=lambda s: (not s.query_aware, s.model, s.length, s.task))
    return [SettingRuns(setting, next((r for r in by_setting[setting] if r["config"]["policy"] == "full"), None),
                        [r for r in by_setting[setting] if r["config"]["policy"] != "full"]) for setting in order]


def summary(groups: list[SettingRuns]) -> str:
    rows = []
    for here in groups:
        setting, family = here.setting, family_of(here.setting.task)
        full = "–" if here.full is None else \
            f"{100 * here.full['metrics']['score']:.0f}" + (" ⚠" if here.cannot_do_task else "")
        for (scorer, budget), tests in here.paired.items():
            scores = [here.cell(scorer, g, budget) for g in GRANULARITY_ORDER]
            order = (_family_index(family), setting.task, setting.length, setting.model, not setting.query_aware,
                     scorer, budget)
            rows.append((order, [family, setting.task, f"{setting.length:,}", setting.model, setting.mode,
                                 f"`{scorer}`", str(budget), full,
                                 *(f"{100 * r['metrics']['score']:.0f}" if r else "–" for r in scores),
                                 *(str(tests[pair]) if tests[pair] else "–" for pair in SUMMARY_PAIRS),
                                 _verdict(tests["head_page", "head"])]))
    columns = ["family", "task", "length", "model", "mode", "scorer", "budget", "full", *GRANULARITY_ORDER,
               *(f"{a} − {b}" for a, b in SUMMARY_PAIRS), "per-head pages vs per-head tokens"]
    lines = [f"**Summary** (scores in points; differences in points with Holm-adjusted p as in the paired tables; "
             f"**bold**: p < {ALPHA:g}; ⚠: the full cache scores below {100 * FULL_CACHE_FLOOR:.0f}, the model "
             "cannot do the task, so differences there are not eviction results)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * 7 + "---:|" * (len(columns) - 8) + "---|"]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in sorted(rows)]
    return "\n".join(lines) + "\n"


def _family_index(family: str) -> int:
    return list(TASK_FAMILIES).index(family) if family in TASK_FAMILIES else len(TASK_FAMILIES)


def _verdict(head_page_vs_head: Paired | None) -> str:
    if head_page_vs_head is None:
        return "–"
    if not head_page_vs_head.significant:
        return "tie"
    return "per-head pages win" if head_page_vs_head.difference > 0 else "per-head pages lose"


def compression_seconds(run: dict, full: dict | None) -> float | None:
    """Query-aware only: query-agnostic prefill also reads the question through each cell's own
    (smaller) cache, so the difference would mix that in."""
    if full is None or not run["config"]["query_aware"]:
        return None
    shared = [run["prefill"][i] - full["prefill"][i] for i in run["prefill"] if i in full["prefill"]]
    return sum(shared) / len(shared) if shared else None


def tables(groups: list[SettingRuns]) -> str:
    out = []
    for here in groups:
        cells, full = here.cells, here.full
        if not cells:
            continue
        budgets = here.budgets
        policies = list(dict.fromkeys(r["config"]["policy"] for r in sorted(cells, key=_policy_order)))
        samples = {r["metrics"]["samples"] for r in (*cells, *([full] if full else []))}
        out.append(f"**{here.setting}** ({'/'.join(map(str, sorted(samples)))} samples a cell; "
                   f"{here.full_cache_note()})" if full else f"**{here.setting}**")
        out.append("")
        out.append("| policy | " + " | ".join(f"score @ {b}" for b in budgets) + " | held / full | held / ideal | "
                   "compression (s) |")
        out.append("|---|" + "---:|" * (len(budgets) + 3))
        for policy in policies:
            row = {r["config"]["budget"]: r for r in cells if r["config"]["policy"] == policy}
            scores = [_score_with_interval(row[b]) if b in row else "–" for b in budgets]
            spread = [row[b] for b in budgets if b in row]
            held = "/".join(f"{r['metrics']['held_over_full']:.3f}" for r in spread)
            ideal = "/".join(f"{r['metrics']['held_over_ideal']:.3f}" for r in spread)
            seconds = [compression_seconds(r, full) for r in spread]
            comp = "/".join(f"{s:.2f}" if s is not None else "–" for s in seconds)
            out.append(f"| `{policy}` | " + " | ".join(scores) + f" | {held} | {ideal} | {comp} |")
        out.append("")
    return "\n".join(out)


def _score_with_interval(run: dict) -> str:
    interval = score_interval(run["records"])
    return f"{100 * run['metrics']['score']:.0f} ({100 * interval.ci_low:.0f}–{100 * interval.ci_high:.0f})"


def paired_tables(groups: list[SettingRuns]) -> str:
    """Per setting: for each scorer and budget, the score difference (points) of each pair of granularities
    and of each granularity against the full cache, with its Holm-adjusted p (`SettingRuns.paired`)."""
    out = []
    for here in groups:
        if not here.cells:
            continue
        warning = f" — {FULL_CACHE_WARNING}" if here.cannot_do_task else ""
        out += [f"**{here.setting}: paired tests** (difference in points, Holm-adjusted p; **bold**: p < 0.05)"
                + warning, "",
                "| scorer @ budget | " + " | ".join(f"{a} − {b}" for a, b in COMPARISONS) + " |",
                "|---|" + "---:|" * len(COMPARISONS)]
        for (scorer, budget), tests in here.paired.items():
            out.append(f"| `{scorer}` @ {budget} | " + " | ".join(str(tests[pair]) if tests[pair] else "–"
                                                                for pair in COMPARISONS) + " |")
        out.append("")
    return "\n".join(out)


def block_table(runs: list[dict]) -> str:
    """H2O's pages at 0.2 on `niah_single_2`, query-aware, per block size: one table per model and length
    that has more than one block size."""
    cells = [r for r in runs if r["config"]["policy"] in ("h2o_head_page", "h2o_page") and r["config"]["budget"] == 0.2
             and r["config"]["query_aware"] and r["config"]["task"] == "ruler:niah_single_2"]
    out = []
    for model, length in sorted({(r["config"]["model"], r["config"]["length"]) for r in cells}):
        here = [r for r in cells if (r["config"]["model"], r["config"]["length"]) == (model, length)]
        sizes = sorted({r["config"]["block_size"] for r in here})
        if len(sizes) < 2:
            continue
        out += [f"**Block size: ruler:niah_single_2, {length:,} tokens, {model}, query-aware**", "",
                "| policy @ 0.2 | " + " | ".join(f"block {s}" for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for policy in ("h2o_head_page", "h2o_page"):
            row = {r["config"]["block_size"]: r["metrics"] for r in here if r["config"]["policy"] == policy}
            out.append(f"| `{policy}` | " + " | ".join(
                f"{100 * row[s]['score']:.0f} ({row[s]['held_over_full']:.3f})" if s in row else "–" for s in sizes)
                + " |")
        out.append("")
    return "\n".join(out)


def _policy_order(run: dict) -> tuple:
    scorer, granularity = split_policy(run["config"]["policy"])
    return scorer, GRANULARITY_ORDER.index(granularity) if granularity else len(GRANULARITY_ORDER)


def plot_families(groups: list[SettingRuns], folder: Path) -> list[Path]:
    """One PNG per task family, model, length and query mode (see the module's docstring); the paths written."""
    by_plot: dict[tuple[str, str, int, bool], list[SettingRuns]] = {}
    for here in groups:
        if here.cells:
            s = here.setting
            by_plot.setdefault((family_of(s.task), s.model, s.length, s.query_aware), []).append(here)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for family, model, length, query_aware in sorted(
            by_plot, key=lambda key: (_family_index(key[0]), key[1], key[2], not key[3])):
        members = by_plot[family, model, length, query_aware]
        kept = [m for m in members if not m.cannot_do_task]
        left_out = [m.setting.task for m in members if m.cannot_do_task]
        mode = members[0].setting.mode
        path = folder / f"granularity-{_slug(family)}-{model}-{length}-{mode}.png"
        _plot_family(kept, f"{family}: {model}, {length:,} tokens, {mode}", left_out, path)
        written.append(path)
    return written


def _plot_family(kept: list[SettingRuns], title: str, left_out: list[str], path: Path) -> None:
    scorers = sorted({scorer for m in kept for scorer in m.scorers})
    budgets = sorted({b for m in kept for b in m.budgets})
    # No pyplot: no global figure state; constrained layout keeps the two-line title off the panels.
    figure = Figure(figsize=(4 * max(1, len(scorers)), 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    tasks = ", ".join(m.setting.task.removeprefix("ruler:") for m in kept) or "none"
    note = ""
    if left_out:
        note = f"; left out, full cache < {100 * FULL_CACHE_FLOOR:.0f}: " + \
            ", ".join(task.removeprefix("ruler:") for task in left_out)
    figure.suptitle(f"{title}\nmean over {tasks}{note}", fontsize=9)
    full_score = None  # the reference only where it covers every task the lines average
    if kept and all(m.full for m in kept):
        full_records = [r for m in kept for r in m.full["records"]]
        full_score = 100 * sum(r["score"] for r in full_records) / len(full_records)
    for index, scorer in enumerate(scorers or [None]):
        axes = figure.add_subplot(1, max(1, len(scorers)), index + 1)
        axes.set_title(scorer if scorer else "no task the full cache can do", fontsize=9)
        axes.set_ylim(-3, 103)
        axes.grid(alpha=0.3)
        axes.set_xlabel("budget (fraction of the prompt kept)")
        if index == 0:
            axes.set_ylabel("score (%)")
        for granularity in GRANULARITY_ORDER if scorer else ():
            points = {}  # budget -> (score, (below, above))
            for budget in budgets:
                cells = [m.cell(scorer, granularity, budget) for m in kept]
                if all(cells):
                    points[budget] = _pooled(cells)
            if points:
                axes.errorbar(list(points), [score for score, _ in points.values()],
                              yerr=list(zip(*(bar for _, bar in points.values()))), marker="o", capsize=3,
                              label=granularity)
        if full_score is not None:
            axes.axhline(full_score, color="gray", linestyle="--", label="full cache")
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.savefig(path, bbox_inches="tight")


def _pooled(cells: list[dict]) -> tuple[float, tuple[float, float]]:
    """The mean score over the cells' samples in points, and its error bar (below, above) in points: the
    pooled samples' 95 % interval (none where the interval has no bounds: a bootstrap of one sample)."""
    records = [r for cell in cells for r in cell["records"]]
    score = 100 * sum(r["score"] for r in records) / len(records)
    interval = score_interval(records)
    if interval.ci_low is None:
        return score, (0.0, 0.0)
    return score, (score - 100 * interval.ci_low, 100 * interval.ci_high - score)


def _slug(family: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", family.lower()).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="run folders written by `evalkit sweep` (runs/<name>)")
    parser.add_argument("--summary-only", action="store_true", help="print the summary table only")
    parser.add_argument("--plots", metavar="DIR", type=Path,
                        help="also write one PNG per task family, model, length and query mode into DIR")
    args = parser.parse_args()
    runs = load(args.folders)
    groups = group(runs)
    print(summary(groups))
    if not args.summary_only:
        print(tables(groups))
        print(paired_tables(groups))
        print(block_table(runs))
    if args.plots:
        for path in plot_families(groups, args.plots):
            print(path)


if __name__ == "__main__":
    main()
