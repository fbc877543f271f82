"""The granularity study's tables and plots (docs/granularity.md), read from the run folders the study's sweeps wrote.

    python scripts/granularity_tables.py runs/granularity runs/granularity-query-agnostic runs/study
    python scripts/granularity_tables.py runs/study --summary-only                  # the summary table alone
    python scripts/granularity_tables.py runs/study --summary-only --plots report/granularity   # + one PNG a family
    python scripts/granularity_tables.py runs/granularity-query-agnostic runs/study --auc --task ruler:niah_single_2

Runs are grouped by setting (block 16 only) as `evalkit report` reads a config: its setting fields (task,
length, samples, model, seed, dtype, the data's offset and digest: what makes the prompts and references)
and its variant fields but granularity (query mode, prefill, chunk size, decode eviction, policy arguments,
sliding layers, layout, block size, page pool), so that runs paired on a sample id hold the same sample.
Headings name the task, length, model and query mode, and any other field that differs between the
settings shown of the same model, length and query mode. Runs of the scenarios where the cache turns over
(`TURNS_OVER`: scripts/scenario_tables.py's) are left out. Within a setting a run is its policy's (scorer,
granularity) (`policy_family`: aliases and `--granularity` runs count as the preset they run) at a budget;
two runs there are an error. Each setting's reference is the full-cache run of its `RunConfig.full_cache`. A run still going is shown with
the samples it has finished; one that has finished none is left out. A setting whose full cache scores
below FULL_CACHE_FLOOR is marked (⚠): the model cannot do that task even without eviction, so what the
policies score there says nothing about eviction.

`--task` keeps the runs of the tasks named. `--auc` prints only `auc_table`: per model, length and query mode, a
scorer a row, a granularity a column, the mean score over the budgets every granularity of the row ran; where
runs are still going, the heading says how many samples they have finished (`samples=` is what they will hold).
`--variants` prints only `variant_table`: each run with policy arguments against its scorer without them, at
every granularity (one change at a time: `kvzip_head:layerwise=true` against pooled per-head tokens, and
against per-head pages at the same per-layer budgets). `--modes` prints only `mode_table`: each question-seen
run against the same run with the question unseen (same model, length, task and every other field), Holm-adjusted
over a setting's tests.

Printed in order (`--summary-only`: the first two):
- the summary: per task family (TASK_FAMILIES), task, length, model, query mode, scorer and budget that
  has a run, the full cache's and the four granularities' scores (each on every sample its run finished),
  the three paired comparisons that answer the study's question (head_page − head, head_page − page,
  head_page − token, each with n, the samples both runs finished, that it is computed on) and the verdict
  of per-head pages against per-head tokens: head_page − head's p, Holm-adjusted once more across the
  summary's rows (`verdicts`), decides a win or a loss; otherwise no difference was detected;
- every full-cache run, policy cells or not, with its interval (`full_cache_table`);
- per setting: score per policy (scorer x granularity) and budget with its 95 % interval, then per cell
  the KV held over the full cache, held over ideal (tokens kept), and the prefill compression time;
- per setting, the paired tests (`SettingRuns.paired`; the summary shows the same numbers): each
  granularity against each other one of the same scorer and budget, and each against the full cache, on
  the samples both runs finished: exact McNemar for pass/fail scores (a paired permutation test where scores are
  fractions, as `evalkit.uncertainty.compare` chooses), Holm-adjusted over these ten within a scorer x
  budget, a comparison that cannot be made counting as p = 1;
- the block-size slice, where the folders hold more than one block size;
- with `--failures` (also with `--summary-only`), per setting whose every reference is one string of digits:
  per cell, its failures on the samples the full cache answers, by what the answer's first number is — the
  value's first digits, another number of the value's length, another number, or none (`failures_table`).
A cell of a shared-prefill sweep records the shared forward plus its own compression as `prefill_seconds`;
the full cache's cell of the same sample shares the forward and compresses nothing, so the difference's
median over samples is the compression's time, less what copying the whole prompt's KV into the full cache's
branch costs over copying what a cell keeps (negative at 8,192 tokens).

`--plots DIR` writes, per task family and setting but task and policy arguments,
`granularity-<family>-<model>-<length>-<mode>.png` (then the setting's other fields that differ between
the settings shown of that model, length and mode, if any): one panel per scorer (rows of four beyond five
panels), the family's score against the budget, one line per granularity (a policy-argument variant dotted, in
its granularity's colour), pooled over the family's tasks (the mean over their samples) with the
pooled samples' 95 % interval (`score_interval`: Wilson for pass/fail scores), and the full cache dashed.
Tasks whose full cache scores below FULL_CACHE_FLOOR are left out (the title names them), but where every
task of the family is below it: then all of them are drawn and the title says ⚠ (what eviction keeps of
what the model finds, not an eviction result). A scorer's panel averages the tasks kept that ran it (the
panel's title names them where they are not all of the plot's), and draws a point only where each of them
has the cell, so its lines always average the same tasks; its full cache is theirs (`family_plots`).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from evalkit.config import RunConfig, fields_where
from evalkit.errors import EvalkitError
from evalkit.policies.names import policy_family, policy_label
from evalkit.report.answer import CAN_DO
from evalkit.results import RunDir
from evalkit.tasks import TASKS
from evalkit.tasks.long_answer import ReciteTask
from evalkit.tasks.multiturn import MultiturnTask
from evalkit.tasks.ppl import Perplexity
from evalkit.uncertainty import Comparison, compare, holm, score_interval
from evalkit.uncertainty.settings import ALPHA

STUDY_BLOCK_SIZE = 16  # the study's block; other sizes are the block-size slice's (`block_table`)
# A full cache scoring below this fails the task by itself: there eviction has little left to lose, and
# differences between policies are noise around the model's failure, not eviction results. The report's and
# the study's threshold (a third: the tasks the grids were chosen for), so every table, plot and page agrees.
FULL_CACHE_FLOOR = CAN_DO
_SAME_SWEEP_SECONDS = 60  # a sweep makes a task's run folders together, before its first sample
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

# The fields that make a setting, as `evalkit report` reads a config (`evalkit.config.setting`): the setting
# fields (the prompts and references: a sample id names the same sample only under the same seed, offset
# and data) and the variant fields (how the policy ran), but granularity, the study's own axis.
SETTING_FIELDS = fields_where(report="setting") + tuple(k for k in fields_where(report="variant")
                                                         if k != "granularity")
_HEADING_FIELDS = ("model", "length", "task", "query_aware")  # always named; the others where they differ
# A field missing from an older run's config ran at its default (`RunConfig.identity` leaves such fields
# out of the id for that reason), so it must not split that run from a newer one.
_DEFAULTS = RunConfig().to_dict()


# The scenarios where the cache turns over (several questions on one context, long answers, token-by-token
# perplexity) have their own tables and plots (scripts/scenario_tables.py): their runs are not single-question cells.
TURNS_OVER = (MultiturnTask, ReciteTask, Perplexity)


def load(folders: list[str]) -> list[dict]:
    """Every run folder of a single-question task (not `TURNS_OVER`) with at least one finished sample; one still
    running (no metrics.json yet) is summarised from its finished samples. Its config holds every RunConfig
    field; a policy run is its (scorer, granularity) as `policy_family` says. A run id in two folders (a later
    grid's cell that an earlier grid already ran: the same config, so the same answers) is one run, the copy
    with more finished samples; an EvalkitError where the copies answer a sample differently."""
    runs: dict[str, dict] = {}
    for folder in folders:
        for predictions in sorted(Path(folder).glob("*/predictions.jsonl")):
            run = predictions.parent
            records = RunDir(folder, run.name).predictions()  # skips a last line still being written
            if not records or not _more_of_the_same(runs.get(run.name), run, records):
                continue
            provenance = json.loads((run / "config.json").read_text())
            stored = provenance["config"]
            if _turns_over(stored["task"]):
                continue
            config = {name: stored.get(name, default) for name, default in _DEFAULTS.items()}
            if (run / "metrics.json").exists():
                metrics = json.loads((run / "metrics.json").read_text())
            else:
                held, full, ideal = (sum(r[k] for r in records) for k in ("bytes_held", "bytes_full", "bytes_ideal"))
                metrics = {"samples": len(records), "score": sum(r["score"] for r in records) / len(records),
                           "held_over_full": held / full, "held_over_ideal": held / ideal}
            scorer, granularity = (None, None) if config["policy"] == "full" else \
                policy_family(config["policy"], config["granularity"])
            runs[run.name] = {"folder": run, "config": config, "metrics": metrics, "records": records,
                              "scorer": scorer, "granularity": granularity,  # a StrEnum: equal to its name
                              "prefill": {r["id"]: r["prefill_seconds"] for r in records},
                              "created": provenance.get("created")}
    return list(runs.values())


@functools.cache
def _turns_over(task: str) -> bool:
    """Whether `task` names a registered task of `TURNS_OVER` (a data task, `jsonl:...`, never does)."""
    return task in TASKS.names() and isinstance(TASKS.create(task), TURNS_OVER)


def _more_of_the_same(earlier: dict | None, folder: Path, records: list[dict]) -> bool:
    """Whether `records` (of `folder`) should replace `earlier`, a loaded copy of the same run id."""
    if earlier is None:
        return True
    answers = {r["id"]: (r["prediction"], r["score"]) for r in earlier["records"]}
    if any(answers.get(r["id"], (r["prediction"], r["score"])) != (r["prediction"], r["score"]) for r in records):
        raise EvalkitError(f"{earlier['folder']} and {folder} are copies of one run that answer a sample differently")
    return len(records) > len(earlier["records"])


def family_of(task: str) -> str:
    return next((family for family, tasks in TASK_FAMILIES.items() if task in tasks), OTHER_FAMILY)


class Setting(NamedTuple):
    """Runs that can be compared: the four fields headings name, then the other SETTING_FIELDS as (name,
    JSON text) pairs."""
    model: str
    length: int
    task: str
    query_aware: bool
    others: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, config: dict, leave_out: tuple[str, ...] = ()) -> Setting:
        others = tuple((name, json.dumps(config[name], sort_keys=True, default=str)) for name in SETTING_FIELDS
                       if name not in _HEADING_FIELDS + leave_out)
        return cls(config["model"], config["length"], config["task"], config["query_aware"], others)

    @property
    def mode(self) -> str:
        return "query-aware" if self.query_aware else "query-agnostic"

    def __str__(self) -> str:
        return f"{self.task}, {self.length:,} tokens, {self.model}, {self.mode}"


def differences(settings: Iterable[Setting]) -> dict[Setting, str]:
    """Per setting, its other fields that differ among `settings` (`seed=1, samples=20`; "" where none do),
    so that no two settings shown read alike."""
    settings = list(settings)
    differing = [name for name, _ in settings[0].others
                 if len({dict(s.others)[name] for s in settings}) > 1] if settings else []
    return {s: ", ".join(f"{name}={value}" for name, value in s.others if name in differing) for s in settings}


def differences_within_model_length_and_mode(settings: Iterable[Setting]) -> dict[Setting, str]:
    """`differences` among the settings of each model, length and query mode: settings of another one already
    read apart."""
    alike: dict[tuple, list[Setting]] = {}
    for setting in settings:
        alike.setdefault((setting.model, setting.length, setting.query_aware), []).append(setting)
    return {setting: text for group in alike.values() for setting, text in differences(group).items()}


def _index(runs: Iterable[dict], key: Callable[[dict], tuple]) -> dict[tuple, dict]:
    """`runs` by `key`; an EvalkitError naming both runs where two share one (the table would show either)."""
    indexed: dict[tuple, dict] = {}
    for run in runs:
        other = indexed.setdefault(key(run), run)
        if other is not run:
            raise EvalkitError(f"{other['folder']} and {run['folder']} are runs of the same setting, policy and "
                               "budget: the tables would show only one of them")
    return indexed


@dataclass(frozen=True)
class Paired:
    difference: float  # score of the first run minus the second's on their shared samples, a fraction
    p_value: float  # Holm-adjusted within the scorer x budget's COMPARISONS
    samples: int  # the samples both runs finished, that the difference and the test are on

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA

    def __str__(self) -> str:
        text = f"{100 * self.difference:+.0f} (p = {self.p_value:.2g}, n = {self.samples})"
        return f"**{text}**" if self.significant else text


@dataclass
class SettingRuns:
    setting: Setting
    differs: str  # the setting's fields beyond the heading's four that differ among the settings shown
    full: dict | None
    cells: list[dict]  # every run but the full cache's; at least one

    @property
    def name(self) -> str:
        return f"{self.setting}{self._differs}"

    @property
    def mode(self) -> str:
        return f"{self.setting.mode}{self._differs}"

    @property
    def _differs(self) -> str:
        return f" ({self.differs})" if self.differs else ""

    @property
    def cannot_do_task(self) -> bool:
        return self.full is not None and self.full["metrics"]["score"] < FULL_CACHE_FLOOR

    def full_cache_note(self) -> str:
        score = f"full cache: {100 * self.full['metrics']['score']:.0f}"
        return f"{score} — {FULL_CACHE_WARNING}" if self.cannot_do_task else score

    def cell(self, scorer: str, granularity: str, budget: float) -> dict | None:
        return self._by_policy_and_budget.get((scorer, granularity, budget))

    @functools.cached_property
    def _by_policy_and_budget(self) -> dict[tuple[str, str, float], dict]:
        return {(r["scorer"], r["granularity"], r["config"]["budget"]): r for r in self.cells}

    @property
    def budgets(self) -> list[float]:
        return sorted({r["config"]["budget"] for r in self.cells})

    @property
    def scorers(self) -> list[str]:
        return sorted({r["scorer"] for r in self.cells})

    @functools.cached_property  # the summary and the paired tables show the same tests: run them once
    def paired(self) -> dict[tuple[str, float], dict[tuple[str, str], Paired | None]]:
        """Per (scorer, budget) with at least one run, every pair of COMPARISONS (None where a run is missing
        or the two share fewer than two finished samples), Holm-adjusted over all ten: one that cannot be
        made counts as p = 1, so a missing run never shrinks the family and flatters the others."""
        tests = {}
        for scorer, budget in sorted({(r["scorer"], r["config"]["budget"]) for r in self.cells}):
            runs = {g: self.cell(scorer, g, budget) for g in GRANULARITY_ORDER} | {"full": self.full}
            results = [_compare_shared(runs[a], runs[b]) for a, b in COMPARISONS]
            adjusted = holm([r.p_value if r else 1.0 for r in results])
            tests[scorer, budget] = {pair: Paired(r.difference, float(p), r.n) if r else None
                                     for pair, r, p in zip(COMPARISONS, results, adjusted)}
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
    """The study's policy runs (block STUDY_BLOCK_SIZE) by Setting, each with the full-cache run of its
    `RunConfig.full_cache` (same samples and settings, no policy arguments); query-aware first, then by
    model, length, task. An EvalkitError where two runs share a setting, policy and budget."""
    fulls = _index((r for r in runs if r["config"]["policy"] == "full"), lambda r: Setting.of(r["config"]))
    cells = _index((r for r in runs if r["config"]["policy"] != "full"
                    and r["config"]["block_size"] == STUDY_BLOCK_SIZE),
                   lambda r: (Setting.of(r["config"]), r["scorer"], r["granularity"], r["config"]["budget"]))
    by_setting: dict[Setting, list[dict]] = {}
    for (setting, *_), run in cells.items():
        by_setting.setdefault(setting, []).append(run)
    differs = differences_within_model_length_and_mode(by_setting)
    order = sorted(by_setting, key=lambda s: (not s.query_aware, s.model, s.length, s.task, s.others))
    # Any cell names the full cache: a setting fixes every field `full_cache` keeps or resets.
    return [SettingRuns(setting, differs[setting], fulls.get(_full_cache_setting(by_setting[setting][0])),
                        by_setting[setting]) for setting in order]


def _full_cache_setting(run: dict) -> Setting:
    return Setting.of(RunConfig(**run["config"]).full_cache().to_dict())


def summary(groups: list[SettingRuns]) -> str:
    """One row per setting, scorer and budget with a run (see the module's docstring); the mode column
    carries the setting's other fields that differ, as the headings do."""
    rows = [(here, scorer, budget, tests) for here in groups for (scorer, budget), tests in here.paired.items()]
    lines = []
    for (here, scorer, budget, tests), verdict in zip(rows, verdicts([tests["head_page", "head"]
                                                                      for *_, tests in rows])):
        setting, family = here.setting, family_of(here.setting.task)
        full = "–" if here.full is None else \
            f"{100 * here.full['metrics']['score']:.0f}" + (" ⚠" if here.cannot_do_task else "")
        scores = [here.cell(scorer, g, budget) for g in GRANULARITY_ORDER]
        order = (_family_index(family), setting.task, setting.length, setting.model, not setting.query_aware,
                 setting.others, scorer, budget)
        lines.append((order, [family, setting.task, f"{setting.length:,}", setting.model, here.mode,
                              f"`{scorer}`", str(budget), full,
                              *(f"{100 * r['metrics']['score']:.0f}" if r else "–" for r in scores),
                              *(str(tests[pair]) if tests[pair] else "–" for pair in SUMMARY_PAIRS), verdict]))
    columns = ["family", "task", "length", "model", "mode", "scorer", "budget", "full", *GRANULARITY_ORDER,
               *(f"{a} − {b}" for a, b in SUMMARY_PAIRS), "per-head pages vs per-head tokens"]
    header = [f"**Summary** (scores in points, each on every sample its run finished; differences in points on the "
              f"n samples both runs finished, with Holm-adjusted p as in the paired tables, **bold**: p < {ALPHA:g}; "
              "the verdict's p is head_page − head's, Holm-adjusted once more across the rows; ⚠: the full cache "
              f"scores below {100 * FULL_CACHE_FLOOR:.0f}, the model cannot do the task, so differences there are "
              "not eviction results)", "",
              "| " + " | ".join(columns) + " |", "|" + "---|" * 7 + "---:|" * (len(columns) - 8) + "---|"]
    return "\n".join(header + ["| " + " | ".join(cells) + " |" for _, cells in sorted(lines)]) + "\n"


def auc_table(groups: list[SettingRuns]) -> str:
    """Which scorer and which granularity win, at a glance: per model, length and query mode (and the other
    setting fields but the policy's arguments, which name a row instead), per scorer a row, per granularity the
    area under its score-over-budget curve divided by the budgets' span (the trapezoid rule over the budgets
    every granularity of the row ran: a mean score over budgets, in points), averaged over the tasks whose full
    cache scores at least FULL_CACHE_FLOOR and where every granularity of the row ran those budgets. Each cell
    scores the samples every cell of its row and task finished, so the row's granularities are compared on the
    same samples; the full cache's column is its score on those samples. Rows by their best AUC, best first; a
    row's best in bold."""
    sections: dict[tuple, dict[tuple, dict[str, dict[str, dict]]]] = {}
    finished: dict[tuple, set[int]] = {}  # per section, how many samples its runs have finished
    for here in groups:
        if here.cannot_do_task or here.full is None:
            continue
        for run in here.cells:
            section = (not here.setting.query_aware, here.setting.model, here.setting.length,
                       _without_arguments(here.setting).others)
            finished.setdefault(section, set()).update({len(run["records"]), len(here.full["records"])})
            row = (run["scorer"], json.dumps(run["config"]["policy_args"], sort_keys=True))
            cells = sections.setdefault(section, {}).setdefault(row, {}).setdefault(here.setting.task,
                                                                                      {"full": here.full})
            cells.setdefault(run["granularity"], {})[run["config"]["budget"]] = run
    lines = []
    for (agnostic, model, length, others), rows in sorted(sections.items()):
        extra = ", ".join(f"{name}={value}" for name, value in others if name in ("samples", "seed"))
        counts = finished[(agnostic, model, length, others)]
        fewest, most = min(counts), max(counts)
        if fewest < int(dict(others).get("samples", fewest)):  # a grid still running: say how far its runs are
            extra += f"; running: {fewest}{f' to {most}' if most > fewest else ''} samples finished"
        lines += [f"**{model}, {length:,} tokens, {'query-agnostic' if agnostic else 'query-aware'}"
                  f"{f' ({extra})' if extra else ''}**: mean score over budgets (AUC / span, points)", "",
                  "| scorer | " + " | ".join(GRANULARITY_ORDER) + " | full cache | budgets | tasks |",
                  "|---|" + "---:|" * 5 + "---|---|"]
        table = [_auc_row(scorer, json.loads(arguments), by_task) for (scorer, arguments), by_task in rows.items()]
        for _, cells in sorted(row for row in table if row):
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def variant_table(groups: list[SettingRuns]) -> str:
    """One change at a time: each run with policy arguments (a variant: `kvzip_head:layerwise=true` keeps each
    layer to its own budget) against the same scorer without them in the same setting and budget, at its own
    granularity (what the arguments alone are worth) and at each other granularity that ran (per-head tokens
    with each layer's budget against per-head pages, which keep each layer's budget too), on the samples both
    finished; Holm-adjusted over a variant's tests."""
    plain = {_without_arguments(here.setting): here for here in groups
             if dict(here.setting.others).get("policy_args") == "{}"}
    lines = ["| setting | variant | budget | variant's score | against | its score | variant − it (p Holm, n) |",
             "|---|---|---|---:|---|---:|---|"]
    for here in groups:
        arguments = json.loads(dict(here.setting.others).get("policy_args", "{}"))
        base = plain.get(_without_arguments(here.setting))
        if not arguments or base is None:
            continue
        pairs = [(run, base.cell(run["scorer"], g, run["config"]["budget"]), g) for run in here.cells
                 for g in GRANULARITY_ORDER]
        pairs = [(run, other, g) for run, other, g in pairs if other is not None]
        results = [_compare_shared(run, other) for run, other, _ in pairs]
        for (run, other, g), result, p in zip(pairs, results, holm([r.p_value if r else 1.0 for r in results])):
            label = f"`{run['scorer']}` {run['granularity']} " + " ".join(f"{k}={v}" for k, v in sorted(arguments.items()))
            test = Paired(result.difference, p, result.n) if result else "–"
            lines.append(f"| {here.setting.task}, {here.setting.length:,}, {here.setting.mode} | {label} | "
                         f"{run['config']['budget']} | {100 * run['metrics']['score']:.0f} | `{run['scorer']}` {g} | "
                         f"{100 * other['metrics']['score']:.0f} | {test} |")
    return "\n".join(lines) + "\n"


def mode_table(groups: list[SettingRuns]) -> str:
    """Seeing the question: each question-seen run against the same policy, granularity and budget with the
    question unseen (the same model, length, task and every other field), on the samples both finished;
    Holm-adjusted over a setting's tests."""
    unseen = {here.setting._replace(query_aware=True): here for here in groups if not here.setting.query_aware}
    lines = ["| setting | policy | budget | question seen | unseen | seen − unseen (p Holm, n) |",
             "|---|---|---|---:|---:|---|"]
    for here in groups:
        other = unseen.get(here.setting) if here.setting.query_aware else None
        if other is None:
            continue
        pairs = [(run, other.cell(run["scorer"], run["granularity"], run["config"]["budget"])) for run in
                 sorted(here.cells, key=lambda r: (r["scorer"], _granularity_index(r["granularity"]),
                                                   r["config"]["budget"]))]
        pairs = [(seen, unseen_run) for seen, unseen_run in pairs if unseen_run is not None]
        results = [_compare_shared(seen, unseen_run) for seen, unseen_run in pairs]
        arguments = " ".join(f"{k}={v}" for k, v in
                             sorted(json.loads(dict(here.setting.others).get("policy_args", "{}")).items()))
        for (seen, unseen_run), result, p in zip(pairs, results, holm([r.p_value if r else 1.0 for r in results])):
            test = Paired(result.difference, p, result.n) if result else "–"
            lines.append(f"| {here.setting.task}, {here.setting.length:,}, {here.setting.model} | "
                         f"`{seen['scorer']}` {seen['granularity']}{' ' + arguments if arguments else ''} | "
                         f"{seen['config']['budget']} | {100 * seen['metrics']['score']:.0f} | "
                         f"{100 * unseen_run['metrics']['score']:.0f} | {test} |")
    return "\n".join(lines) + "\n"


def _granularity_index(granularity: str) -> int:
    return GRANULARITY_ORDER.index(granularity) if granularity in GRANULARITY_ORDER else len(GRANULARITY_ORDER)


def _without_arguments(setting: Setting) -> Setting:
    return setting._replace(others=tuple(item for item in setting.others if item[0] != "policy_args"))


def _auc_row(scorer: str, arguments: dict, by_task: dict[str, dict[str, dict]]):
    """(sort key, cells) of one scorer's row, or None where no task has two budgets at every granularity.
    by_task: per task, "full" (the full cache's run) and per granularity its runs by budget."""
    granularities = sorted({g for cells in by_task.values() for g in cells if g != "full"},
                           key=GRANULARITY_ORDER.index)
    by_task = {task: cells for task, cells in by_task.items() if len(cells) == len(granularities) + 1}
    budgets = sorted(set.intersection(*(set(cells[g]) for cells in by_task.values() for g in granularities))) \
        if by_task else []
    if len(budgets) < 2:
        return None
    areas: dict[str, list[float]] = {g: [] for g in granularities}
    full = []
    for cells in by_task.values():
        runs = [cells[g][b] for g in granularities for b in budgets] + [cells["full"]]
        shared = set.intersection(*({r["id"] for r in run["records"]} for run in runs))
        full.append(100 * statistics.fmean(r["score"] for r in cells["full"]["records"] if r["id"] in shared))
        for g in granularities:
            scores = [statistics.fmean(r["score"] for r in cells[g][b]["records"] if r["id"] in shared) for b in budgets]
            area = sum((b1 - b0) * (s0 + s1) / 2 for b0, b1, s0, s1 in zip(budgets, budgets[1:], scores, scores[1:]))
            areas[g].append(100 * area / (budgets[-1] - budgets[0]))
    means = {g: statistics.fmean(values) for g, values in areas.items()}
    best = max(means.values())
    label = f"`{scorer}`" + "".join(f" {k}={v}" for k, v in sorted(arguments.items()))
    cells = [label, *(("–" if g not in means else f"**{means[g]:.0f}**" if means[g] == best else f"{means[g]:.0f}")
                      for g in GRANULARITY_ORDER), f"{statistics.fmean(full):.0f}",
             " / ".join(f"{b:g}" for b in budgets), ", ".join(t.removeprefix("ruler:") for t in sorted(by_task))]
    return (-best, label), cells


def verdicts(tests: list[Paired | None]) -> list[str]:
    """Per summary row, per-head pages against per-head tokens from its head_page − head test: the summary
    asks that question once a row, so its p (already Holm-adjusted within the row's scorer x budget) is
    Holm-adjusted again across the rows that have the test; a win or a loss only where that p < ALPHA."""
    done = [test.p_value for test in tests if test is not None]
    across = iter(holm(done) if done else ())
    return [_verdict(test, float(next(across))) if test else "–" for test in tests]


def _verdict(test: Paired, across_rows: float) -> str:
    if across_rows >= ALPHA:
        return f"no difference detected (n = {test.samples}; p = {across_rows:.2g} across rows)"
    outcome = "per-head pages win" if test.difference > 0 else "per-head pages lose"
    return f"{outcome} (p = {across_rows:.2g} across rows)"


def _family_index(family: str) -> int:
    return list(TASK_FAMILIES).index(family) if family in TASK_FAMILIES else len(TASK_FAMILIES)


def compression_seconds(run: dict, full: dict | None) -> float | None:
    """Query-aware only: query-agnostic prefill also reads the question through each cell's own
    (smaller) cache, so the difference would mix that in. Only where the full cache shared the cell's
    prefill: the same sweep made both folders, within seconds, before its first sample; a full cache run by
    another sweep (a baseline sweep before the grid) timed its own prompt forward. The median over the
    samples: a sweep paused mid-sample (SIGSTOP while the machine is needed) times the pause into one cell."""
    if full is None or not run["config"]["query_aware"] or not _made_together(run, full):
        return None
    shared = [run["prefill"][i] - full["prefill"][i] for i in run["prefill"] if i in full["prefill"]]
    return statistics.median(shared) if shared else None


def _made_together(a: dict, b: dict) -> bool:
    if a["created"] is None or b["created"] is None:
        return False
    apart = datetime.fromisoformat(a["created"]) - datetime.fromisoformat(b["created"])
    return abs(apart.total_seconds()) <= _SAME_SWEEP_SECONDS


def tables(groups: list[SettingRuns]) -> str:
    out = []
    for here in groups:
        cells, full, budgets = here.cells, here.full, here.budgets
        samples = {r["metrics"]["samples"] for r in (*cells, *([full] if full else []))}
        out.append(f"**{here.name}** ({'/'.join(map(str, sorted(samples)))} samples a cell; "
                   f"{here.full_cache_note()})" if full else f"**{here.name}**")
        out.append("")
        out.append("| policy | " + " | ".join(f"score @ {b}" for b in budgets) + " | held / full | held / ideal | "
                   "compression (s) |")
        out.append("|---|" + "---:|" * (len(budgets) + 3))
        for scorer, granularity in sorted({(r["scorer"], r["granularity"]) for r in cells},
                                          key=lambda p: (p[0], GRANULARITY_ORDER.index(p[1]))):
            row = {b: here.cell(scorer, granularity, b) for b in budgets}
            scores = [_score_with_interval(row[b]) if row[b] else "–" for b in budgets]
            spread = [r for r in row.values() if r]
            held = "/".join(f"{r['metrics']['held_over_full']:.3f}" for r in spread)
            ideal = "/".join(f"{r['metrics']['held_over_ideal']:.3f}" for r in spread)
            seconds = [compression_seconds(r, full) for r in spread]
            comp = "/".join(f"{s:.2f}" if s is not None else "–" for s in seconds)
            label = policy_label(spread[0]["config"]["policy"], spread[0]["config"]["granularity"])
            out.append(f"| `{label}` | " + " | ".join(scores) + f" | {held} | {ideal} | {comp} |")
        out.append("")
    return "\n".join(out)


def full_cache_table(runs: list[dict]) -> str:
    """Every full-cache run, policy cells or not: what the model can do at each task, length and model before
    anything is evicted (a sweep of `full` alone measures it before the grid is planned). One row per run:
    family, task, length, model, mode, score with its 95 % interval, samples, ⚠ below FULL_CACHE_FLOOR."""
    fulls = sorted((r for r in runs if r["config"]["policy"] == "full"),
                   key=lambda r: (r["config"]["model"], r["config"]["length"], _family_index(family_of(r["config"]["task"])),
                                  r["config"]["task"], not r["config"]["query_aware"]))
    if not fulls:
        return ""
    lines = ["**Full cache** (score with its 95 % interval; ⚠: below "
             f"{100 * FULL_CACHE_FLOOR:.0f}, the model cannot do the task)", "",
             "| family | task | length | model | mode | full cache | samples |", "|---|---|---|---|---|---:|---:|"]
    for run in fulls:
        config = run["config"]
        mark = " ⚠" if run["metrics"]["score"] < FULL_CACHE_FLOOR else ""
        lines.append(f"| {family_of(config['task'])} | {config['task']} | {config['length']:,} | {config['model']} | "
                     f"{Setting.of(config).mode} | {_score_with_interval(run)}{mark} | {len(run['records'])} |")
    return "\n".join(lines) + "\n"


def _score_with_interval(run: dict) -> str:
    interval = score_interval(run["records"])
    if interval.ci_low is None:  # a bootstrap of one fractional score, a run just begun: no interval yet
        return f"{100 * run['metrics']['score']:.0f} (n = {len(run['records'])})"
    return f"{100 * run['metrics']['score']:.0f} ({100 * interval.ci_low:.0f}–{100 * interval.ci_high:.0f})"


def paired_tables(groups: list[SettingRuns]) -> str:
    """Per setting: for each scorer and budget with a run, the score difference (points) of each pair of
    granularities and of each granularity against the full cache, with its Holm-adjusted p and the samples
    it is on (`SettingRuns.paired`)."""
    out = []
    for here in groups:
        warning = f" — {FULL_CACHE_WARNING}" if here.cannot_do_task else ""
        out += [f"**{here.name}: paired tests** (difference in points, Holm-adjusted p, shared samples n; "
                f"**bold**: p < {ALPHA:g})" + warning, "",
                "| scorer @ budget | " + " | ".join(f"{a} − {b}" for a, b in COMPARISONS) + " |",
                "|---|" + "---:|" * len(COMPARISONS)]
        for (scorer, budget), tests in here.paired.items():
            out.append(f"| `{scorer}` @ {budget} | " + " | ".join(str(tests[pair]) if tests[pair] else "–"
                                                                for pair in COMPARISONS) + " |")
        out.append("")
    return "\n".join(out)


FAILURE_KINDS = ("first digits", "value-length number", "other number", "no number")


def failure_kind(prediction: str, value: str) -> str:
    """How an answer that misses the numeric needle `value` misses it, by the answer's first run of digits:
    the value's first digits (`26.` for 2656973: the value began and was cut; a single digit counts, one
    chance in ten by coincidence), another number of the value's length (another needle's value, or one
    made up), another number (`1.`, `500.`), or no number at all."""
    number = re.search(r"[0-9]+", prediction)
    if number is None:
        return "no number"
    digits = number.group()
    if value.startswith(digits):
        return "first digits"
    return "value-length number" if len(digits) == len(value) else "other number"


def failures_table(groups: list[SettingRuns]) -> str:
    """Per setting whose every reference is one string of digits (the needles with a 7-digit value), per cell:
    the samples the full cache answers that the cell finished, and those it fails, counted by `failure_kind` —
    what eviction took of the value."""
    out = []
    for here in groups:
        if here.full is None or not all(len(r["references"]) == 1 and re.fullmatch("[0-9]+", r["references"][0])
                                        for r in here.full["records"]):
            continue
        answered = {r["id"]: r["references"][0] for r in here.full["records"] if r["score"] == 1.0}
        out += [f"**{here.name}: what the failures kept** (samples the full cache answers, {len(answered)} of "
                f"{len(here.full['records'])}, that the cell does not; by the answer's first number)", "",
                "| policy @ budget | answered, finished here | failures | " + " | ".join(FAILURE_KINDS) + " |",
                "|---|" + "---:|" * (len(FAILURE_KINDS) + 2)]
        for run in sorted(here.cells, key=lambda r: (r["scorer"], GRANULARITY_ORDER.index(r["granularity"]),
                                                     r["config"]["budget"])):
            finished = [r for r in run["records"] if r["id"] in answered]
            kinds = [failure_kind(r["prediction"], answered[r["id"]]) for r in finished if r["score"] < 1.0]
            label = policy_label(run["config"]["policy"], run["config"]["granularity"])
            out.append(f"| `{label}` @ {run['config']['budget']} | {len(finished)} | {len(kinds)} | "
                       + " | ".join(str(kinds.count(kind)) for kind in FAILURE_KINDS) + " |")
        out.append("")
    return "\n".join(out)


def block_table(runs: list[dict]) -> str:
    """H2O's pages at 0.2 on `niah_single_2`, query-aware, per block size: one table per setting (its block
    size aside) that has more than one block size."""
    cells = _index((r for r in runs if r["scorer"] == "h2o" and r["granularity"] in ("head_page", "page")
                    and r["config"]["budget"] == 0.2 and r["config"]["query_aware"]
                    and r["config"]["task"] == "ruler:niah_single_2"),
                   lambda r: (Setting.of(r["config"], leave_out=("block_size",)), r["granularity"],
                              r["config"]["block_size"]))
    sizes: dict[Setting, set[int]] = {}
    for setting, _, size in cells:
        sizes.setdefault(setting, set()).add(size)
    shown = sorted(setting for setting in sizes if len(sizes[setting]) > 1)
    out = []
    for setting, differs in differences(shown).items():
        row_sizes = sorted(sizes[setting])
        out += [f"**Block size: {setting}" + (f" ({differs})" if differs else "") + "**", "",
                "| policy @ 0.2 | " + " | ".join(f"block {s}" for s in row_sizes) + " |",
                "|---|" + "---:|" * len(row_sizes)]
        for granularity in ("head_page", "page"):
            row = {s: cells.get((setting, granularity, s)) for s in row_sizes}
            out.append(f"| `h2o_{granularity}` | " + " | ".join(
                f"{100 * r['metrics']['score']:.0f} ({r['metrics']['held_over_full']:.3f})" if r else "–"
                for r in row.values()) + " |")
        out.append("")
    return "\n".join(out)


@dataclass
class Panel:
    """One scorer's panel: the tasks kept that ran the scorer, pooled."""
    tasks: list[str]
    # granularity -> budget -> (pooled score, (error below, above)), in points
    lines: dict[str, dict[float, tuple[float, tuple[float, float]]]]
    full_score: float | None  # the pooled full cache, only where every one of `tasks` has it


@dataclass
class FamilyPlot:
    """What one family's plot draws (`family_plots`)."""
    title: str
    file_name: str
    tasks: list[str]  # the tasks kept: those the full cache can do (all of them where it can do none)
    left_out: list[str]  # the family's tasks whose full cache scores below FULL_CACHE_FLOOR
    below_floor: bool  # every task of the family is, and `tasks` are all of them
    panels: dict[str, Panel]  # by scorer


def family_plots(groups: list[SettingRuns]) -> list[FamilyPlot]:
    """Per task family and setting but task and policy arguments: the family's tasks the full cache can do,
    pooled per scorer over those that ran it; a policy-argument variant (`kvzip_head:layerwise=true`) is a line of
    its scorer's panel, named "head layerwise=true". A point is kept only where each of a line's tasks has the
    cell, so a line always averages the same tasks."""
    by_plot: dict[tuple, list[SettingRuns]] = {}
    for here in groups:
        s = _without_arguments(here.setting)
        by_plot.setdefault((_family_index(family_of(s.task)), s.model, s.length, not s.query_aware, s.others),
                           []).append(here)
    differs = differences_within_model_length_and_mode({_without_arguments(here.setting) for here in groups})
    plots = []
    for key in sorted(by_plot):
        members = by_plot[key]
        family, first = family_of(members[0].setting.task), _without_arguments(members[0].setting)
        kept = [m for m in members if not m.cannot_do_task]
        below_floor = not kept
        kept = kept or members
        panels = {}
        for scorer in sorted({scorer for m in kept for scorer in m.scorers}):
            lines, tasks, full_score = {}, None, None
            for variant in sorted({_arguments(m.setting) for m in kept if scorer in m.scorers}):
                ran = [m for m in kept if scorer in m.scorers and _arguments(m.setting) == variant]
                budgets = sorted({b for m in ran for b in m.budgets})
                for granularity in GRANULARITY_ORDER:
                    cells = {b: [m.cell(scorer, granularity, b) for m in ran] for b in budgets}
                    points = {b: _pooled(found) for b, found in cells.items() if all(found)}
                    if points or not variant:
                        lines[f"{granularity} {variant}".strip()] = points
                if tasks is None:  # the scorer's own runs first ("" sorts first), else its first variant's
                    tasks = [m.setting.task for m in ran]
                    full_score = _pooled([m.full for m in ran])[0] if all(m.full for m in ran) else None
            panels[scorer] = Panel(tasks, lines, full_score)
        mode = first.mode + (f" ({differs[first]})" if differs[first] else "")
        name = "-".join([_slug(family), first.model, str(first.length), first.mode,
                         *([_slug(differs[first])] if differs[first] else [])])
        plots.append(FamilyPlot(f"{family}: {first.model}, {first.length:,} tokens, {mode}",
                                f"granularity-{name}.png", sorted({m.setting.task for m in kept}),
                                sorted({m.setting.task for m in members if m.cannot_do_task and not below_floor}),
                                below_floor, panels))
    return plots


def _arguments(setting: Setting) -> str:
    """The setting's policy arguments as `name=value` pairs ("" for none)."""
    arguments = json.loads(dict(setting.others).get("policy_args", "{}"))
    return ", ".join(f"{name}={value}" for name, value in sorted(arguments.items()))


def plot_families(groups: list[SettingRuns], folder: Path) -> list[Path]:
    """One PNG per `family_plots` entry (see the module's docstring); the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for plot in family_plots(groups):
        _draw(plot, folder / plot.file_name)
        written.append(folder / plot.file_name)
    return written


_PANELS_IN_ONE_ROW = 5  # more scorers than this (the frontier grids') wrap into rows of 4 panels


def _draw(plot: FamilyPlot, path: Path) -> None:
    scorers = list(plot.panels)
    columns = max(1, len(scorers)) if len(scorers) <= _PANELS_IN_ONE_ROW else 4
    rows = -(-max(1, len(scorers)) // columns)
    # No pyplot: no global figure state; constrained layout keeps the two-line title off the panels.
    figure = Figure(figsize=(4 * columns, 3.8 * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    tasks = ", ".join(task.removeprefix("ruler:") for task in plot.tasks) or "none"
    note = ""
    if plot.left_out:
        note = f"; left out, full cache < {100 * FULL_CACHE_FLOOR:.0f}: " + \
            ", ".join(task.removeprefix("ruler:") for task in plot.left_out)
    if plot.below_floor:
        note = f"\n⚠ full cache < {100 * FULL_CACHE_FLOOR:.0f} on every task: not eviction results"
    figure.suptitle(f"{plot.title}\nmean over {tasks}{note}", fontsize=9)
    for index, scorer in enumerate(scorers or [None]):
        axes = figure.add_subplot(rows, columns, index + 1)
        panel = plot.panels.get(scorer)
        title = scorer or "no cell"
        if panel and panel.tasks != plot.tasks:
            title += " (" + ", ".join(task.removeprefix("ruler:") for task in panel.tasks) + ")"
        axes.set_title(title, fontsize=9)
        axes.set_ylim(-3, 103)
        axes.grid(alpha=0.3)
        axes.set_xlabel("budget (fraction of the prompt kept)")
        if index % columns == 0:
            axes.set_ylabel("score (%)")
        for line, points in (panel.lines if panel else {}).items():
            if points:  # a granularity's colour; its policy-argument variants dotted
                granularity, _, variant = line.partition(" ")
                axes.errorbar(list(points), [score for score, _ in points.values()],
                              yerr=list(zip(*(bar for _, bar in points.values()))), marker="o", capsize=3,
                              color=f"C{GRANULARITY_ORDER.index(granularity)}", linestyle=":" if variant else "-",
                              label=line)
        if panel and panel.full_score is not None:
            axes.axhline(panel.full_score, color="gray", linestyle="--", label="full cache")
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
    # max: an interval of equal scores may miss the mean by rounding, and a bar is never negative
    return score, (max(0.0, score - 100 * interval.ci_low), max(0.0, 100 * interval.ci_high - score))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="run folders written by `evalkit sweep` (runs/<name>)")
    parser.add_argument("--summary-only", action="store_true", help="print the summary table only")
    parser.add_argument("--task", action="append", metavar="TASK",
                        help="only the runs of this task (repeat for several; default: every task)")
    parser.add_argument("--variants", action="store_true",
                        help="print only each policy-argument variant against its scorer without them")
    parser.add_argument("--auc", action="store_true",
                        help="print the table of mean scores over budgets alone (scorer x granularity, per mode)")
    parser.add_argument("--modes", action="store_true",
                        help="print only each question-seen run against the same run with the question unseen")
    parser.add_argument("--failures", action="store_true",
                        help="also print, per needle setting, how each cell's failed answers miss the value")
    parser.add_argument("--plots", metavar="DIR", type=Path,
                        help="also write one PNG per task family and setting (but task) into DIR")
    args = parser.parse_args()
    try:
        runs = [run for run in load(args.folders) if not args.task or run["config"]["task"] in args.task]
        groups = group(runs)
        if args.auc or args.variants or args.modes:
            print(auc_table(groups) if args.auc else variant_table(groups) if args.variants else mode_table(groups))
            return
        print(summary(groups))
        print(full_cache_table(runs))
        if not args.summary_only:
            print(tables(groups))
            print(paired_tables(groups))
            print(block_table(runs))
        if args.failures:
            print(failures_table(groups))
        if args.plots:
            for path in plot_families(groups, args.plots):
                print(path)
    except EvalkitError as error:  # the runs cannot be tabled as they are: one line, no traceback
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
