"""The multi-turn study's tables and plot (docs/granularity.md, "When the cache turns over"), from run folders.

    .venv/bin/python scripts/turn_tables.py runs/study [--task ruler:multiturn_niah] [--plot docs/img/turns.png]
    .venv/bin/python scripts/turn_tables.py runs/study --summary   # scorer x granularity, the mean over turns

For each model × length × query mode: a row per policy and budget with its samples, each turn's score (%), the
mean over turns with its 95 % interval, and the KV held as the last turn's answer began (% of the full cache
then); then, per scorer and budget, each granularity against per-head tokens on the same samples (the mean over
turns per sample; `evalkit compare`'s paired test, Holm-adjusted over the family of comparisons printed). Runs
still being written are read as far as they go (only samples every compared run has finished are paired).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from evalkit.policies.names import policy_family
from evalkit.report.answer import policy_name
from evalkit.uncertainty import compare, holm, score_interval
from evalkit.uncertainty.settings import ALPHA

GRANULARITIES = ("head", "head_page", "token", "page")


def load(folders: list[str], task: str) -> list[dict]:
    runs = []
    for folder in folders:
        for config_path in sorted(Path(folder).glob("*/config.json")):
            config = json.loads(config_path.read_text())["config"]
            predictions = config_path.parent / "predictions.jsonl"
            if config["task"] != task or not predictions.exists():
                continue
            records = []
            for line in predictions.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line being written
                    break
            if records and "turns" in records[0]:
                runs.append({"config": config, "records": records})
    return runs


def setting_of(config: dict) -> tuple:
    return (config["model"], config["length"], "question seen" if config["query_aware"] else "question unseen")


def row(run: dict) -> dict:
    records, config = run["records"], run["config"]
    turns = len(records[0]["turns"])
    interval = score_interval(records)
    last_held = sum(r["turns"][-1]["bytes_held"] for r in records) / sum(r["turns"][-1]["bytes_full"] for r in records)
    return {"policy": policy_name(config), "budget": config["budget"], "n": len(records),
            "by_turn": [sum(r["turns"][t]["score"] for r in records) / len(records) for t in range(turns)],
            "mean": sum(r["score"] for r in records) / len(records), "ci": (interval.ci_low, interval.ci_high),
            "held": last_held}


def family_of(config: dict) -> tuple[str, str]:
    """(scorer, granularity) of what a run ran."""
    scorer, granularity = policy_family(config["policy"], config.get("granularity"))
    return scorer, granularity.value


def paired(runs: list[dict]) -> list[tuple[str, str, float, object]]:
    """(scorer, granularity, budget, Comparison against per-head tokens) on the samples both finished."""
    by_key = {(*family_of(r["config"]), r["config"]["budget"]): r for r in runs if r["config"]["policy"] != "full"}
    tests = []
    for (scorer, granularity, budget), run in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        base = by_key.get((scorer, "head", budget))
        if granularity == "head" or base is None:
            continue
        ids = {r["id"] for r in run["records"]} & {r["id"] for r in base["records"]}
        if len(ids) < 2:
            continue
        a = [r for r in run["records"] if r["id"] in ids]
        b = [r for r in base["records"] if r["id"] in ids]
        tests.append((scorer, granularity, budget, compare(a, b, detect=None)))
    return tests


def print_tables(runs: list[dict]) -> None:
    for setting in sorted({setting_of(r["config"]) for r in runs}, key=str):
        here = [r for r in runs if setting_of(r["config"]) == setting]
        rows = sorted((row(r) for r in here), key=lambda x: (x["policy"] != "full", x["policy"], x["budget"]))
        turns = len(rows[0]["by_turn"])
        print(f"\n### {setting[0]}, {setting[1]} tokens, {setting[2]}\n")
        print("| policy | budget | n | " + " | ".join(f"turn {t + 1}" for t in range(turns))
              + " | mean over turns (95 % CI) | KV held / full, last turn |")
        print("|---|---|---|" + "---|" * turns + "---|---|")
        for x in rows:
            low, high = x["ci"]
            ci = f" ({100 * low:.1f}–{100 * high:.1f})" if low is not None else ""
            print(f"| {x['policy']} | {x['budget']} | {x['n']} | " + " | ".join(f"{100 * s:.1f}" for s in x["by_turn"])
                  + f" | {100 * x['mean']:.1f}{ci} | {100 * x['held']:.1f}% |")
        tests = paired(here)
        if tests:
            adjusted = holm([t.p_value for *_, t in tests])
            print(f"\nEach granularity against per-head tokens, same scorer and budget (mean over turns per sample; "
                  f"Holm over these {len(tests)} tests):\n")
            print("| scorer | granularity | budget | n | difference (points) | p (Holm) |")
            print("|---|---|---|---|---|---|")
            for (scorer, granularity, budget, test), p in zip(tests, adjusted):
                print(f"| {scorer} | {granularity} | {budget} | {test.n} | {100 * test.difference:+.1f} | {p:.3g} |")


def print_summary(runs: list[dict]) -> None:
    """Per setting, the mean score over turns (%) of each scorer at each budget, a column per granularity."""
    for setting in sorted({setting_of(r["config"]) for r in runs}, key=str):
        here = [r for r in runs if setting_of(r["config"]) == setting]
        cells = {(*family_of(r["config"]), r["config"]["budget"]): row(r) for r in here
                 if r["config"]["policy"] != "full"}
        full = next((row(r) for r in here if r["config"]["policy"] == "full"), None)
        n = min(x["n"] for x in cells.values())
        print(f"\n### {setting[0]}, {setting[1]} tokens, {setting[2]}: mean over turns, % (n ≥ {n} a cell"
              + (f"; full cache {100 * full['mean']:.1f}" if full else "") + ")\n")
        print("| scorer | budget | " + " | ".join(GRANULARITIES) + " |")
        print("|---|---|" + "---:|" * len(GRANULARITIES))
        for scorer, budget in sorted({(scorer, budget) for scorer, _, budget in cells}):
            shown = [f"{100 * cells[scorer, g, budget]['mean']:.1f}" if (scorer, g, budget) in cells else ""
                     for g in GRANULARITIES]
            print(f"| {scorer} | {budget} | " + " | ".join(shown) + " |")


def plot(runs: list[dict], path: Path) -> None:
    """Score by turn, a panel per budget, a line per granularity (the mean over the scorers run at all four)."""
    budgets = sorted({r["config"]["budget"] for r in runs if r["config"]["policy"] != "full"})
    figure = Figure(figsize=(4 * len(budgets), 3.4), dpi=110)
    rows = [(r, row(r)) for r in runs]
    full = next((x for r, x in rows if r["config"]["policy"] == "full"), None)
    families = {family_of(r["config"]) for r, _ in rows if r["config"]["policy"] != "full"}
    every = sorted(s for s in {scorer for scorer, _ in families}
                   if {g for scorer, g in families if scorer == s} >= set(GRANULARITIES))
    for number, budget in enumerate(budgets, 1):
        axes = figure.add_subplot(1, len(budgets), number)
        for color, granularity in zip(matplotlib.colormaps["tab10"].colors, GRANULARITIES):
            lines = [x["by_turn"] for r, x in rows if r["config"]["budget"] == budget
                     and family_of(r["config"])[1] == granularity and family_of(r["config"])[0] in every]
            if lines:
                mean = [100 * sum(column) / len(column) for column in zip(*lines)]
                axes.plot(range(1, len(mean) + 1), mean, marker="o", color=color, label=granularity)
        if full is not None:
            axes.plot(range(1, len(full["by_turn"]) + 1), [100 * s for s in full["by_turn"]], color="gray",
                      linestyle="--", label="full cache")
        axes.set_title(f"budget {budget}", fontsize=9)
        axes.set_ylim(-3, 103)
        axes.set_xlabel("turn")
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
    figure.axes[0].set_ylabel("score (%)")
    figure.axes[-1].legend(fontsize=8)
    n = min(x["n"] for _, x in rows)
    figure.suptitle(f"Score by turn, a line per granularity: the mean over {', '.join(every)} (n ≥ {n} a cell)",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--task", default="ruler:multiturn_niah")
    parser.add_argument("--plot", type=Path, help="write the score-by-turn figure here")
    parser.add_argument("--summary", action="store_true", help="only the mean over turns, scorer x granularity")
    args = parser.parse_args()
    runs = load(args.folders, args.task)
    if not runs:
        raise SystemExit(f"no {args.task} runs under {', '.join(args.folders)}")
    (print_summary if args.summary else print_tables)(runs)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
