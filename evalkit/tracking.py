"""Weights & Biases mirror of a run: offline unless credentials exist, never required."""

from __future__ import annotations

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
    columns = ["id", "prompt_tokens", "prediction", "references", "score", "kept_tokens", "bytes_held"]
    table = wandb.Table(columns=columns, data=[[str(r[c]) if c in ("references",) else r[c] for c in columns]
                                              for r in records])
    run.log({"predictions": table})
    run.summary.update(metrics)
    where = run.dir
    run.finish()
    return where
