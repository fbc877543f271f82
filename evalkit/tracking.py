"""Weights & Biases mirror of a run: offline unless credentials exist, never required."""

from __future__ import annotations

import json
import netrc
import os
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


def log_run(mode: str, run_dir: Path, run_id: str, config: dict, metrics: dict, records: list[dict]) -> str | None:
    """Log config, summary metrics and the per-sample table; returns where W&B wrote, if anywhere."""
    if mode == "off":
        return None
    import wandb

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "evalkit"), name=run_id, id=run_id,
                     config=config, dir=str(run_dir), mode=mode, resume="allow", reinit="finish_previous",
                     settings=wandb.Settings(silent=True))
    columns = sorted({key for record in records for key in record})
    rows = [[_cell(r.get(c)) for c in columns] for r in records]
    for i in range(len(columns)):  # W&B wants one type per column: a mixed column becomes text
        if len({type(row[i]) for row in rows if row[i] is not None}) > 1:
            for row in rows:
                row[i] = None if row[i] is None else str(row[i])
    table = wandb.Table(columns=columns, data=rows)
    run.log({"predictions": table})
    run.summary.update(metrics)
    where = run.dir
    run.finish()
    return where


def _cell(value):
    """W&B tables hold scalars; lists and dicts (references, meta) go in as JSON text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value, default=str)
