"""The granularity study's tables (docs/granularity.md), read from the run folders the study's sweeps wrote.

    python scripts/granularity_tables.py runs/granularity runs/granularity-query-agnostic

A run still going is shown with the samples it has finished. For each task and query mode: score per policy
(scorer x granularity) and budget with its 95 % Wilson interval, then per cell the KV held over the full cache,
held over ideal (tokens kept), and the prefill compression time; then the paired tests (`paired_tables`):
each granularity against each other one of the same scorer and budget, and each against the full cache,
exact McNemar on the same samples, Holm-adjusted within a scorer x budget as `evalkit report` does. A cell of a
shared-prefill sweep records the shared forward plus its own compression as `prefill_seconds`; the full
cache's cell of the same sample shares the forward and compresses nothing, so the difference, averaged
over samples, is the compression's time (plus the fork's noise).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from statsmodels.stats.multitest import multipletests

from evalkit.uncertainty import ALPHA, compare, score_interval


def load(folders: list[str]) -> list[dict]:
    """Every run folder; one still running (no metrics.json yet) is summarised from its finished samples."""
    runs = []
    for folder in folders:
        for predictions in sorted(Path(folder).glob("*/predictions.jsonl")):
            run = predictions.parent
            config = json.loads((run / "config.json").read_text())["config"]
            records = [json.loads(line) for line in predictions.read_text().splitlines() if line.endswith("}")]
            if (run / "metrics.json").exists():
                metrics = json.loads((run / "metrics.json").read_text())
            else:
                held, full, ideal = (sum(r[k] for r in records) for k in ("bytes_held", "bytes_full", "bytes_ideal"))
                metrics = {"samples": len(records), "score": sum(r["score"] for r in records) / len(records),
                           "held_over_full": held / full, "held_over_ideal": held / ideal}
            runs.append({"config": config, "metrics": metrics, "records": records,
                         "prefill": {r["id"]: r["prefill_seconds"] for r in records}})
    return runs


def compression_seconds(run: dict, full: dict | None) -> float | None:
    """Query-aware only: query-agnostic prefill also reads the question through each cell's own
    (smaller) cache, so the difference would mix that in."""
    if full is None or not run["config"]["query_aware"]:
        return None
    shared = [run["prefill"][i] - full["prefill"][i] for i in run["prefill"] if i in full["prefill"]]
    return sum(shared) / len(shared) if shared else None


def tables(runs: list[dict]) -> str:
    out = []
    settings = sorted({(r["config"]["task"], r["config"]["query_aware"]) for r in runs}, key=lambda s: (not s[1], s[0]))
    for task, query_aware in settings:
        here = [r for r in runs if (r["config"]["task"], r["config"]["query_aware"]) == (task, query_aware)
                and r["config"]["block_size"] == 16]
        fulls = [r for r in here if r["config"]["policy"] == "full"]
        full = fulls[0] if fulls else None
        cells = [r for r in here if r["config"]["policy"] != "full"]
        if not cells:
            continue
        budgets = sorted({r["config"]["budget"] for r in cells})
        policies = list(dict.fromkeys(r["config"]["policy"] for r in sorted(cells, key=_policy_order)))
        samples = {r["metrics"]["samples"] for r in here}
        mode = "query-aware" if query_aware else "query-agnostic"
        out.append(f"**{task}, {mode}** ({'/'.join(map(str, sorted(samples)))} samples a cell; full cache: "
                   f"{100 * full['metrics']['score']:.0f})" if full else f"**{task}, {mode}**")
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


PAIRS = (("head_page", "head"), ("head_page", "token"), ("page", "token"), ("head_page", "page"), ("head", "token"),
         ("page", "head"))


def paired_tables(runs: list[dict]) -> str:
    """Per task and query mode: for each scorer and budget, the score difference (points) of each pair of
    granularities and of each granularity against the full cache, with its Holm-adjusted exact McNemar p."""
    out = []
    settings = sorted({(r["config"]["task"], r["config"]["query_aware"]) for r in runs}, key=lambda s: (not s[1], s[0]))
    for task, query_aware in settings:
        here = [r for r in runs if (r["config"]["task"], r["config"]["query_aware"]) == (task, query_aware)
                and r["config"]["block_size"] == 16]
        full = next((r for r in here if r["config"]["policy"] == "full"), None)
        cells = {(r["config"]["policy"], r["config"]["budget"]): r for r in here if r["config"]["policy"] != "full"}
        scorers = sorted({policy.rsplit("_", 2 if policy.endswith("head_page") else 1)[0] for policy, _ in cells})
        mode = "query-aware" if query_aware else "query-agnostic"
        out += [f"**{task}, {mode}: paired tests** (difference in points, Holm-adjusted p; **bold**: p < 0.05)", "",
                "| scorer @ budget | " + " | ".join(f"{a} − {b}" for a, b in PAIRS)
                + " | " + " | ".join(f"{g} − full" for g in GRANULARITY_ORDER) + " |",
                "|---|" + "---:|" * (len(PAIRS) + len(GRANULARITY_ORDER))]
        for scorer in scorers:
            for budget in sorted({b for _, b in cells}):
                runs_here = {g: cells.get((f"{scorer}_{g}", budget)) for g in GRANULARITY_ORDER}
                tests = [(runs_here[a], runs_here[b]) for a, b in PAIRS] + [(runs_here[g], full) for g in GRANULARITY_ORDER]
                results = [compare(a["records"], b["records"], detect=None) if a and b else None for a, b in tests]
                done = [r for r in results if r is not None]
                adjusted = iter(multipletests([r.p_value for r in done], method="holm")[1]) if done else iter(())
                shown = []
                for result in results:
                    if result is None:
                        shown.append("–")
                        continue
                    p = float(next(adjusted))
                    text = f"{100 * result.difference:+.0f} (p = {p:.2g})"
                    shown.append(f"**{text}**" if p < ALPHA else text)
                out.append(f"| `{scorer}` @ {budget} | " + " | ".join(shown) + " |")
        out.append("")
    return "\n".join(out)


GRANULARITY_ORDER = ("head", "head_page", "token", "page")


def block_table(runs: list[dict]) -> str:
    cells = [r for r in runs if r["config"]["policy"] in ("h2o_head_page", "h2o_page") and r["config"]["budget"] == 0.2
             and r["config"]["query_aware"] and r["config"]["task"] == "ruler:niah_single_2"]
    sizes = sorted({r["config"]["block_size"] for r in cells})
    if len(sizes) < 2:
        return ""
    lines = ["| policy @ 0.2 | " + " | ".join(f"block {s}" for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for policy in ("h2o_head_page", "h2o_page"):
        row = {r["config"]["block_size"]: r["metrics"] for r in cells if r["config"]["policy"] == policy}
        lines.append(f"| `{policy}` | " + " | ".join(
            f"{100 * row[s]['score']:.0f} ({row[s]['held_over_full']:.3f})" if s in row else "–" for s in sizes) + " |")
    return "\n".join(lines)


def _policy_order(run: dict) -> tuple:
    scorer, _, granularity = run["config"]["policy"].partition("_")
    order = {"head": 0, "head_page": 1, "token": 2, "page": 3}
    return scorer, order.get(granularity, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    runs = load(args.folders)
    print(tables(runs))
    print(paired_tables(runs))
    print(block_table(runs))


if __name__ == "__main__":
    main()
