"""The tables and plots of the scenarios where the cache turns over (docs/granularity.md, "When the cache turns
over", issue #48), from run folders: several questions on one context (`ruler:multiturn_niah`,
`ruler:multiturn_kv`), long answers (`long:recite_list`, `long:recite_passage`) and token-by-token perplexity
(`ppl`).

    .venv/bin/python scripts/scenario_tables.py runs/study --task ruler:multiturn_niah [--plot docs/img/turns.png]
    .venv/bin/python scripts/scenario_tables.py runs/study --task ppl --model gemma3-270m --plot docs/img/ppl.png
    .venv/bin/python scripts/scenario_tables.py runs/study --task long:recite_list --summary

Runs are grouped by setting: model, length, query mode and the task's arguments (`--model` keeps one model's).
Per setting:
- `--summary`: per scorer and budget, a column per granularity, the run's score as evalkit scores it (the mean
  over turns; lines in order; the perplexity over all scored tokens), the full cache's in the heading; for long
  answers two more tables: each run's answer tokens over the full cache's on the samples both finished (above 1:
  eviction made answers longer, or loop), and the units its answers recite exactly before their first error.
- otherwise a row per run: samples, score with its 95 % interval, then per scenario: each turn's score and the
  KV held as the last turn's answer began; the mean word-level edit similarity and the answer tokens over the
  full cache's; nothing more for perplexity. Then each granularity against per-head tokens of the same scorer and
  budget on the samples both finished (`evalkit compare`'s paired test, Holm-adjusted over the tests printed).
- `--plot FILE`: multi-turn, the score by turn, a panel per budget; long answers and perplexity, the score
  against the budget, a panel per scorer; a line per granularity, the full cache dashed.
- `--survival FILE` (long answers): the share of samples whose first i units are all exact, against i, a panel
  per budget, a line per granularity: where along a long answer eviction breaks it.
A run with policy args (`kvzip_head:layerwise=true`) is a scorer of its own (`kvzip layerwise=true`: a row of the
summary, a dotted line in its scorer's panel), and the tables set it against its scorer at each granularity.
Runs still being written are read as far as they go (a torn last line is left for later).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from evalkit.policies.names import policy_family
from evalkit.report.answer import policy_name
from evalkit.tasks import TASKS
from evalkit.uncertainty import compare, holm, score_interval, score_of

GRANULARITIES = ("head", "head_page", "token", "page")


def load(folders: list[str], task: str, model: str | None = None) -> list[dict]:
    """Each run of `task` (and `model`, if given) with a finished sample: its config and records."""
    runs = []
    for folder in folders:
        for config_path in sorted(Path(folder).glob("*/config.json")):
            config = json.loads(config_path.read_text())["config"]
            predictions = config_path.parent / "predictions.jsonl"
            if config["task"] != task or model not in (None, config["model"]) or not predictions.exists():
                continue
            records = []
            for line in predictions.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line being written
                    break
            if records:
                runs.append({"config": config, "records": records})
    return runs


def kind_of(runs: list[dict]) -> str:
    record = runs[0]["records"][0]
    return "turns" if "turns" in record else "perplexity" if "nll" in record else "answers"


def setting_of(config: dict) -> tuple:
    mode = "question seen" if config["query_aware"] else "question unseen"
    arguments = ", ".join(f"{k}={v}" for k, v in sorted(config.get("task_args", {}).items()))
    return config["model"], config["length"], mode, arguments


def heading(setting: tuple) -> str:
    model, length, mode, arguments = setting
    return f"{model}, {length:,} tokens, {mode}" + (f", {arguments}" if arguments else "")


def family_of(config: dict) -> tuple[str, str]:
    """(scorer, granularity) of what a run ran, the scorer followed by its policy args where the run set any
    (`kvzip layerwise=true`: a row of its own); the full cache's is ("full", "")."""
    if config["policy"] == "full":
        return "full", ""
    scorer, granularity = policy_family(config["policy"], config.get("granularity"))
    return " ".join([scorer, *arguments_of(config)]), granularity.value


def arguments_of(config: dict) -> list[str]:
    return [f"{key}={value}" for key, value in sorted(config.get("policy_args", {}).items())]


def cells_of(runs: list[dict]) -> dict[tuple, dict]:
    """{(scorer, granularity, budget): run}, the full cache's under ("full", "", 1.0)."""
    return {(*family_of(r["config"]), r["config"]["budget"]): r for r in runs}


def at_every_granularity(cells: dict[tuple, dict]) -> list[str]:
    """The scorers run at every granularity the setting's grid ran: all four, or per head and per-head pages on a
    model with one KV head (Gemma 3 270M, where a shared unit keeps what a per-head one keeps)."""
    ran = {granularity for _, granularity, _ in cells if granularity}
    return sorted(s for s in {scorer for scorer, *_ in cells}
                  if {g for scorer, g, _ in cells if scorer == s} >= ran)


def shared(a: list[dict], b: list[dict]) -> tuple[list[dict], list[dict]]:
    """The records of the samples both runs finished, in `a`'s order."""
    ids = {r["id"] for r in a} & {r["id"] for r in b}
    by_id = {r["id"]: r for r in b}
    return [r for r in a if r["id"] in ids], [by_id[r["id"]] for r in a if r["id"] in ids]


def length_over_full(run: dict, full: dict | None) -> float | None:
    """The run's answer tokens over the full cache's, on the samples both finished."""
    if full is None:
        return None
    mine, theirs = shared(run["records"], full["records"])
    total = sum(r["new_tokens"] for r in theirs)
    return sum(r["new_tokens"] for r in mine) / total if total else None


def paired(runs: list[dict]) -> list[tuple[str, str, float, object]]:
    """(scorer, granularity, budget, Comparison against per-head tokens) on the samples both finished."""
    by_key = cells_of(runs)
    tests = []
    for (scorer, granularity, budget), run in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        base = by_key.get((scorer, "head", budget))
        if granularity == "head" or base is None:
            continue
        a, b = shared(run["records"], base["records"])
        if len(a) >= 2:
            tests.append((scorer, granularity, budget, compare(a, b, detect=None)))
    return tests


def variant_tests(runs: list[dict]) -> list[tuple[str, str, str, float, object]]:
    """(variant, its granularity, the scorer's granularity, budget, Comparison) for each run with policy args
    against its scorer without them, at every granularity, same budget, on the samples both finished:
    `kvzip_head_page:pool_pages=true` against `kvzip_head` is the unit at the same pooling, against
    `kvzip_head_page` the pooling at the same unit."""
    by_key = cells_of(runs)
    tests = []
    for run in sorted((r for r in runs if arguments_of(r["config"])), key=lambda r: str(family_of(r["config"]))):
        variant, granularity = family_of(run["config"])
        scorer, budget = variant.split(" ")[0], run["config"]["budget"]
        for other in GRANULARITIES:
            base = by_key.get((scorer, other, budget))
            a, b = shared(run["records"], base["records"]) if base else ([], [])
            if len(a) >= 2:
                tests.append((variant, granularity, other, budget, compare(a, b, detect=None)))
    return tests


def _points(kind: str, value: float) -> str:
    return f"{value:.2f}" if kind == "perplexity" else f"{100 * value:.1f}"


def _difference(kind: str, test) -> str:
    return f"{test.difference:+.2f}" if kind == "perplexity" else f"{100 * test.difference:+.1f}"


def summary(runs: list[dict]) -> str:
    kind, lines = kind_of(runs), []
    for setting, here in by_setting(runs):
        if baseline_alone(here):
            lines += [baseline_line(kind, setting, here), ""]
            continue
        cells = cells_of(here)
        full = cells.get(("full", "", 1.0))
        score = "perplexity" if kind == "perplexity" else "mean over turns, %" if kind == "turns" else "score, %"
        n = min(len(r["records"]) for r in here)
        lines += [f"### {heading(setting)}: {score} (n ≥ {n} a cell"
                  + (f"; full cache {_points(kind, score_of(full['records']))}" if full else "") + ")", ""]
        lines += _grid(cells, lambda run: _points(kind, score_of(run["records"])))
        if kind == "answers":
            lines += ["", "Answer tokens over the full cache's, on the samples both finished:", ""]
            lines += _grid(cells, lambda run: f"{length_over_full(run, full):.2f}" if full else "")
            lines += ["", "Units (lines, sentences) recited exactly from the first, before the first error (mean"
                      + (f"; full cache {_mean(recited(full)):.1f}" if full else "") + "):", ""]
            lines += _grid(cells, lambda run: f"{_mean(recited(run)):.1f}")
        lines.append("")
    return "\n".join(lines)


def recited(run: dict) -> list[int]:
    """Per sample of a long-answer run, the units its answer recites exactly before the first error
    (`ReciteTask.recited_prefix`): how far into the answer eviction lets it stay exact."""
    task = TASKS.create(run["config"]["task"]).with_args(run["config"].get("task_args", {}))
    return [task.recited_prefix(r["prediction"], r["references"]) for r in run["records"]]


def survival(run: dict) -> list[float]:
    """[i - 1]: the share (%) of the samples whose first i units are all exact, among those with i units or more."""
    pairs = [(n, len(r["references"])) for n, r in zip(recited(run), run["records"])]
    return [100 * sum(n >= i for n, units in pairs if units >= i) / sum(units >= i for _, units in pairs)
            for i in range(1, max(units for _, units in pairs) + 1)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _grid(cells: dict, shown) -> list[str]:
    rows = sorted({(scorer, budget) for scorer, _, budget in cells if scorer != "full"})
    return ["| scorer | budget | " + " | ".join(GRANULARITIES) + " |", "|---|---|" + "---:|" * len(GRANULARITIES),
            *(f"| {scorer} | {budget} | " + " | ".join(shown(cells[scorer, g, budget]) if (scorer, g, budget) in cells
                                                      else "" for g in GRANULARITIES) + " |"
              for scorer, budget in rows)]


def tables(runs: list[dict]) -> str:
    kind, lines = kind_of(runs), []
    for setting, here in by_setting(runs):
        if baseline_alone(here):
            lines += [baseline_line(kind, setting, here), ""]
            continue
        full = next((r for r in here if r["config"]["policy"] == "full"), None)
        turns = len(here[0]["records"][0]["turns"]) if kind == "turns" else 0
        extra = {"turns": [f"turn {t + 1}" for t in range(turns)] + ["KV held / full, last turn"],
                 "answers": ["edit similarity", "answer tokens / full cache's"], "perplexity": []}[kind]
        lines += [f"### {heading(setting)}", "", "| policy | budget | n | score (95 % CI) | " + " | ".join(extra) + " |",
                  "|---|---|---|---|" + "---|" * len(extra)]
        for run in sorted(here, key=lambda r: (r["config"]["policy"] != "full", policy_name(r["config"]),
                                               r["config"]["budget"])):
            records, interval = run["records"], score_interval(run["records"])
            ci = f" ({_points(kind, interval.ci_low)}–{_points(kind, interval.ci_high)})" \
                if interval.ci_low is not None else ""
            if kind == "turns":
                held = sum(r["turns"][-1]["bytes_held"] for r in records) / sum(r["turns"][-1]["bytes_full"]
                                                                                  for r in records)
                more = [_points(kind, sum(r["turns"][t]["score"] for r in records) / len(records))
                        for t in range(turns)] + [f"{100 * held:.1f}%"]
            elif kind == "answers":
                ratio = length_over_full(run, full)
                more = [f"{100 * sum(r['details']['edit_similarity'] for r in records) / len(records):.1f}",
                        "" if ratio is None else f"{ratio:.2f}"]
            else:
                more = []
            arguments = ",".join(arguments_of(run["config"]))
            label = policy_name(run["config"]) + (f":{arguments}" if arguments else "")
            lines.append(f"| {label} | {run['config']['budget']} | {len(records)} | "
                         f"{_points(kind, score_of(records))}{ci} | " + " | ".join(more) + " |")
        tests = paired(here)
        if tests:
            lines += ["", f"Each granularity against per-head tokens, same scorer and budget (Holm over these "
                          f"{len(tests)} tests):", "", "| scorer | granularity | budget | n | difference | p (Holm) |",
                      "|---|---|---|---|---|---|"]
            for (scorer, granularity, budget, test), p in zip(tests, holm([t.p_value for *_, t in tests])):
                lines.append(f"| {scorer} | {granularity} | {budget} | {test.n} | {_difference(kind, test)} | "
                             f"{p:.3g} |")
        variants = variant_tests(here)
        if variants:
            lines += ["", "Each policy-argument variant against its scorer at each granularity, same budget (Holm "
                          "over each variant's tests):", "",
                      "| variant | against | budget | n | difference | p (Holm) |", "|---|---|---|---|---|---|"]
            for name in dict.fromkeys(variant for variant, *_ in variants):
                family = [row for row in variants if row[0] == name]
                for (variant, granularity, other, budget, test), p in zip(family,
                                                                           holm([t.p_value for *_, t in family])):
                    lines.append(f"| {variant} {granularity} | {variant.split(' ')[0]} {other} | {budget} | "
                                 f"{test.n} | {_difference(kind, test)} | {p:.3g} |")
        lines.append("")
    return "\n".join(lines)


def by_setting(runs: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """The runs by setting, those where a policy ran first: a figure draws the first, and a full cache run alone
    (a model's baseline, to see whether it can do the task) is no grid."""
    settings = sorted({setting_of(r["config"]) for r in runs}, key=str)
    groups = [(s, [r for r in runs if setting_of(r["config"]) == s]) for s in settings]
    return sorted(groups, key=lambda group: baseline_alone(group[1]))


def baseline_alone(runs: list[dict]) -> bool:
    return all(r["config"]["policy"] == "full" for r in runs)


def baseline_line(kind: str, setting: tuple, runs: list[dict]) -> str:
    (full,) = runs
    return (f"### {heading(setting)}: the full cache alone, {_points(kind, score_of(full['records']))} "
            f"(n = {len(full['records'])}); no policy ran")


def plot(runs: list[dict], path: Path) -> Figure:
    """One figure for the first setting where a policy ran (`--task` and the folders choose it), written to
    `path`. Perplexity on a log scale (a budget of a few pages can multiply it); the legend in the panel with the
    most lines, the last of those, so that it names every granularity drawn."""
    kind = kind_of(runs)
    setting, here = by_setting(runs)[0]
    cells = cells_of(here)
    full = cells.pop(("full", "", 1.0), None)
    if kind == "turns":
        panels = sorted({budget for *_, budget in cells})
        every = at_every_granularity(cells)
    else:  # a panel per scorer, its policy-argument variants in it (dotted)
        panels = sorted({scorer.split(" ")[0] for scorer, *_ in cells})
    figure = Figure(figsize=(3.6 * len(panels), 3.4), dpi=110)
    for number, panel in enumerate(panels, 1):
        axes = figure.add_subplot(1, len(panels), number)
        for color, granularity in zip(matplotlib.colormaps["tab10"].colors, GRANULARITIES):
            if kind == "turns":  # the mean by turn over the scorers run at every granularity
                lines = [by_turn(run) for (s, g, b), run in cells.items() if b == panel and g == granularity
                         and s in every]
                if lines:
                    axes.plot(range(1, len(lines[0]) + 1), [sum(c) / len(c) for c in zip(*lines)], marker="o",
                              color=color, label=granularity)
            else:
                for scorer in sorted({s for s, *_ in cells if s.split(" ")[0] == panel}):
                    points = sorted((b, score_of(run["records"])) for (s, g, b), run in cells.items()
                                    if s == scorer and g == granularity)
                    if points:
                        variant = scorer.removeprefix(panel)
                        axes.plot(*zip(*[(b, _scale(kind, y)) for b, y in points]), marker="o", color=color,
                                  linestyle=":" if variant else "-", label=granularity + variant)
        if full is not None:
            line = by_turn(full) if kind == "turns" else [_scale(kind, score_of(full["records"]))] * 2
            xs = range(1, len(line) + 1) if kind == "turns" else axes.get_xlim()
            axes.plot(xs, line, color="gray", linestyle="--", label="full cache")
        axes.set_title(f"budget {panel}" if kind == "turns" else panel, fontsize=9)
        axes.set_xlabel("turn" if kind == "turns" else "budget")
        if kind == "turns":
            axes.xaxis.get_major_locator().set_params(integer=True)
        if kind == "perplexity":
            axes.set_yscale("log")
            for set_formatter, formatter in ((axes.yaxis.set_major_formatter, LogFormatter()),
                                             (axes.yaxis.set_minor_formatter, LogFormatter(labelOnlyBase=False))):
                set_formatter(formatter)  # 40, not 4 × 10^1
        else:
            axes.set_ylim(-3, 103)
        axes.grid(alpha=0.3)
    figure.axes[0].set_ylabel({"turns": "score (%)", "answers": "score (%)",
                               "perplexity": "perplexity (log scale)"}[kind])
    max(reversed(figure.axes), key=lambda axes: len(axes.get_lines())).legend(fontsize=8)
    about = f"the mean over {', '.join(every)}" if kind == "turns" else "a panel per scorer"
    figure.suptitle(f"{heading(setting)}: a line per granularity, {about}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    return figure


def plot_survival(runs: list[dict], path: Path) -> None:
    """Long answers, the first setting where a policy ran: the share of samples still exact after i units, a panel
    per budget, a line per granularity (the mean over the scorers run at every granularity), the full cache
    dashed."""
    setting, here = by_setting(runs)[0]
    cells = cells_of(here)
    full = cells.pop(("full", "", 1.0), None)
    panels = sorted({budget for *_, budget in cells})
    every = at_every_granularity(cells)
    figure = Figure(figsize=(3.6 * len(panels), 3.4), dpi=110)
    for number, budget in enumerate(panels, 1):
        axes = figure.add_subplot(1, len(panels), number)
        for color, granularity in zip(matplotlib.colormaps["tab10"].colors, GRANULARITIES):
            curves = [survival(run) for (s, g, b), run in cells.items() if b == budget and g == granularity
                      and s in every]
            if curves:
                mean = [sum(c) / len(c) for c in zip(*curves)]
                axes.plot(range(1, len(mean) + 1), mean, color=color, label=granularity)
        if full is not None:
            line = survival(full)
            axes.plot(range(1, len(line) + 1), line, color="gray", linestyle="--", label="full cache")
        axes.set_title(f"budget {budget}", fontsize=9)
        axes.set_xlabel("units into the answer")
        axes.set_ylim(-3, 103)
        axes.grid(alpha=0.3)
    figure.axes[0].set_ylabel("samples still exact (%)")
    figure.axes[-1].legend(fontsize=8)
    figure.suptitle(f"{heading(setting)}: a line per granularity, the mean over {', '.join(every)}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


def by_turn(run: dict) -> list[float]:
    records = run["records"]
    return [100 * sum(r["turns"][t]["score"] for r in records) / len(records) for t in range(len(records[0]["turns"]))]


def _scale(kind: str, value: float) -> float:
    return value if kind == "perplexity" else 100 * value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--task", default="ruler:multiturn_niah")
    parser.add_argument("--model", help="only this model's runs (e.g. smollm2-135m): the figures draw the first "
                                        "setting, and the models sort by name")
    parser.add_argument("--plot", type=Path, help="write the figure of the first setting here")
    parser.add_argument("--summary", action="store_true", help="only the scores, scorer x granularity")
    parser.add_argument("--survival", type=Path, help="long answers: write the figure of samples still exact "
                                                      "after each unit here (the first setting)")
    args = parser.parse_args()
    runs = load(args.folders, args.task, args.model)
    if not runs:
        sys.exit(f"error: no {args.task} runs{f' of {args.model}' if args.model else ''} under "
                 f"{', '.join(args.folders)}")
    print(summary(runs) if args.summary else tables(runs))
    if (args.plot or args.survival) and baseline_alone(by_setting(runs)[0][1]):
        sys.exit(f"error: only full-cache runs of {args.task}: no figure to draw")
    if args.plot:
        plot(runs, args.plot)
    if args.survival:
        if kind_of(runs) != "answers":
            sys.exit(f"error: --survival is for long answers, not {args.task}")
        plot_survival(runs, args.survival)


if __name__ == "__main__":
    main()
