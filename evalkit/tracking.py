"""Weights & Biases mirror of a run: offline unless credentials exist, never required."""

from __future__ import annotations

import json
import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path


def resolve_wandb_mode(requested: str) -> str:
    """'off', 'offline' or 'online'. 'auto' goes online only when credentials exist; WANDB_MODE wins."""
    env = os.environ.get("WANDB_MODE")
    if env in ("disabled", "off"):
        return "off"
    if requested != "auto":
        return requested
    if env in ("offline", "online"):
        return env
    return "online" if _has_credentials() else "offline"


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


@dataclass
class LineSeries:
    """One chart of several named lines, each a list of (x, y) points."""

    title: str
    xname: str
    yname: str
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def log_run(mode: str, run_dir: Path, run_id: str, config: dict, metrics: dict, records: list[dict]) -> str | None:
    """Log config, summary metrics and the per-sample table; returns where W&B wrote, if anywhere."""
    if mode == "off":
        return None
    import wandb

    # The group, when a sweep runs this, comes from WANDB_RUN_GROUP (set by the sweep, read by W&B).
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "evalkit"), name=run_id, id=run_id,
                     config=config, dir=str(run_dir), mode=mode, resume="allow", reinit="finish_previous",
                     settings=wandb.Settings(silent=True))
    run.log({"predictions": _table(records)})
    run.summary.update(metrics)
    where = run.dir
    run.finish()
    return where


def log_sweep(mode: str, sweep_dir: Path, sweep_id: str, config: dict, rows: list[dict],
              charts: dict[str, LineSeries], summary: dict) -> str | None:
    """The sweep-level run, in the same group as its cells: the cells table, one line chart per entry
    of `charts` (quality or memory against budget, one line per policy) and summary numbers."""
    if mode == "off":
        return None
    import wandb

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "evalkit"), name=sweep_id, id=sweep_id,
                     group=sweep_id, job_type="sweep", config=config, dir=str(sweep_dir), mode=mode,
                     resume="allow", reinit="finish_previous", settings=wandb.Settings(silent=True))
    logged = {"cells": _table(rows)}
    for key, chart in charts.items():
        names = list(chart.lines)
        logged[key] = wandb.plot.line_series(
            xs=[[x for x, _ in chart.lines[name]] for name in names],
            ys=[[y for _, y in chart.lines[name]] for name in names],
            keys=names, title=f"{chart.title} ({chart.yname})", xname=chart.xname)
    run.log(logged)
    run.summary.update(summary)
    where = run.dir
    run.finish()
    return where


def _table(records: list[dict]):
    import wandb

    columns = sorted({key for record in records for key in record})
    rows = [[_cell(r.get(c)) for c in columns] for r in records]
    for i in range(len(columns)):  # W&B wants one type per column: a mixed column becomes text
        if len({type(row[i]) for row in rows if row[i] is not None}) > 1:
            for row in rows:
                row[i] = None if row[i] is None else str(row[i])
    return wandb.Table(columns=columns, data=rows)


def _cell(value):
    """W&B tables hold scalars; lists and dicts (references, meta) go in as JSON text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value, default=str)
