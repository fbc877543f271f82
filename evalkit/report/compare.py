"""`evalkit compare A B`: two runs on the same samples, paired (`evalkit.uncertainty.compare`).

A run is its folder, or its run id under `--runs`; `--baseline` compares a run with its full-cache
baseline (`config.baseline_for`) from the same results folder. The command line is `report/command.py`'s.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from evalkit.config import baseline_for
from evalkit.errors import EvalkitError
from evalkit.results import RunDir, complete_runs, read_json
from evalkit.uncertainty import compare, score_interval
from evalkit.uncertainty.records import score_of

# What two runs must share to be compared sample by sample.
_SAME = ("task", "task_args", "length", "model", "seed", "data_sha256")


def compare_runs(a: str, b: str | None, baseline: bool, runs: Path, detect: float, as_json: bool) -> None:
    """`evalkit compare`: prints the comparison of run `a` with run `b` (or its baseline)."""
    if (b is None) == (not baseline):
        raise EvalkitError("give two runs, or one run and --baseline")
    if not 0 < detect < 100:
        raise EvalkitError(f"--detect must be in (0, 100) points, got {detect:g}")
    first = _run(a, runs)
    second = _baseline_of(first) if baseline else _run(b, runs)
    for key in _SAME:
        if first["config"].get(key) != second["config"].get(key):
            raise EvalkitError(f"the runs differ in {key} ({_show(first['config'].get(key))} against "
                               f"{_show(second['config'].get(key))}): they are not on the same samples")
    result = compare(first["records"], second["records"], detect / 100)
    intervals = [score_interval(run["records"]) for run in (first, second)]
    if as_json:
        typer.echo(json.dumps({"a": _summary(first, intervals[0]), "b": _summary(second, intervals[1]),
                               **asdict(result), "significant": result.significant,
                               "verdict": result.verdict()}, indent=2))
        return
    console = Console(highlight=False, soft_wrap=True)
    percent = result.metric == "binary" or result.higher_is_better
    for name, run, interval in (("A", first, intervals[0]), ("B", second, intervals[1])):
        console.print(f"{name}  {escape(run['id'])}  score {_points(run['score'], percent)} "
                      f"[{_points(interval.ci_low, percent)}, {_points(interval.ci_high, percent)}]  "
                      f"n = {interval.n}")
    console.print(f"A − B: {_points(result.difference, percent, signed=True)} "
                  f"[{_points(result.ci_low, percent, signed=True)}, {_points(result.ci_high, percent, signed=True)}]"
                  f" ({result.interval}); {result.test} p = {result.p_value:.3g} (unadjusted); only A better on {result.only_a}, "
                  f"only B on {result.only_b} of {result.n} samples")
    console.print(result.verdict())


def _run(name: str, runs: Path) -> dict:
    folder = Path(name) if Path(name).is_dir() else runs / name
    run_dir = RunDir(folder.parent, folder.name)
    if not run_dir.config_path.exists():
        raise EvalkitError(f"no run {name!r}: neither a run folder nor a run id under {runs}")
    if not run_dir.complete:
        raise EvalkitError(f"run {folder.name} is not complete ({len(run_dir.predictions())} samples recorded)")
    return _loaded(run_dir)


def _loaded(run_dir: RunDir) -> dict:
    records = run_dir.finished_predictions()
    if not records:
        raise EvalkitError(f"run {run_dir.path.name} has no samples")
    if not all(isinstance(r.get("score"), (int, float)) for r in records):
        raise EvalkitError(f"run {run_dir.path.name} has no per-sample scores to compare")
    metrics = run_dir.metrics()
    _check_agreement(run_dir.path.name, metrics, records)
    return {"id": run_dir.path.name, "folder": str(run_dir.path), "config": read_json(run_dir.config_path)["config"],
            "score": metrics["score"], "records": records}


def _check_agreement(name: str, metrics: dict, records: list[dict]) -> None:
    """The score printed (metrics.json) and the n, interval and test (predictions.jsonl) come from two files:
    they must say the same, or one was changed after the run."""
    n = metrics.get("n", metrics.get("samples"))
    if n != len(records):
        raise EvalkitError(f"run {name}: metrics.json counts {n} samples and predictions.jsonl holds "
                           f"{len(records)}: the files disagree")
    recorded, recomputed = metrics.get("score"), score_of(records)
    if not isinstance(recorded, (int, float)) or not math.isclose(recorded, recomputed, rel_tol=1e-9, abs_tol=1e-12):
        raise EvalkitError(f"run {name}: metrics.json's score {recorded} is not its predictions' "
                           f"{recomputed:.6g}: the files disagree")


def _baseline_of(run: dict) -> dict:
    root = Path(run["folder"]).parent
    stored = [(provenance.get("config", {}), provenance) for provenance, _ in complete_runs(root)]
    found = baseline_for(run["config"], stored)
    if found is None:
        raise EvalkitError(f"no full-cache baseline of {run['id']} in {root}")
    return _loaded(RunDir(root, found["run_id"]))


def _summary(run: dict, interval) -> dict:
    return {"run": run["id"], "score": run["score"], **interval.as_metrics()}


def _points(value: float | None, percent: bool, signed: bool = False) -> str:
    """A score in points (percent), or as is (perplexity)."""
    if value is None:
        return "-"
    return format(100 * value if percent else value, ("+" if signed else "") + (".1f" if percent else ".2f"))


def _show(value) -> str:
    return json.dumps(value, default=str)
