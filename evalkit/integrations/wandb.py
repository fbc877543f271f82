"""Weights & Biases mirror of a run: offline unless credentials and a route exist, never required.

W&B can never cost a result: the mode is decided before any work (`decide_wandb_mode`), and
logging happens after the results are on disk, a failure being one warning line.
"""

from __future__ import annotations

import http.client
import json
import netrc
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from evalkit.errors import EvalkitError

DEFAULT_BASE_URL = "https://api.wandb.ai"
REACH_TIMEOUT_S = 5.0


def decide_wandb_mode(requested: str, say: Callable[[str], None]) -> str:
    """'off', 'offline' or 'online', before any work. WANDB_MODE=disabled/off wins, and WANDB_MODE
    stands in for 'auto'. 'auto' goes online only with credentials and a route to W&B (checked within
    5 s; without one it logs offline and says so in one line); 'online' without either is refused."""
    env = os.environ.get("WANDB_MODE")
    if env in ("disabled", "off"):
        return "off"
    if requested == "auto" and env in ("offline", "online"):
        requested = env
    if requested in ("off", "offline"):
        return requested
    url = os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    if not _has_credentials(url):
        if requested == "online":
            raise EvalkitError("--wandb online needs W&B credentials: set WANDB_API_KEY or run `wandb login` "
                               "(or log with --wandb offline and `wandb sync` later)")
        return "offline"
    problem = _unreachable(url)
    if problem is None:
        return "online"
    if requested == "online":
        raise EvalkitError(f"--wandb online: W&B at {url} is not reachable ({problem}); "
                           "log with --wandb offline and `wandb sync` later")
    say(f"W&B at {url} is not reachable ({problem}): logging offline; `wandb sync` uploads it later")
    return "offline"


def _has_credentials(url: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        # W&B reads the file NETRC names, if set, as wandb login writes it.
        path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
        return netrc.netrc(path).authenticators(urllib.parse.urlsplit(url).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _unreachable(url: str) -> str | None:
    """Why W&B gives no HTTP answer within REACH_TIMEOUT_S (through the proxy the environment names, as
    W&B's own requests go), or None. Name resolution is bounded too: the request runs in a thread that
    is not waited for beyond the timeout."""
    outcome: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=REACH_TIMEOUT_S).close()
            outcome.append(None)
        except urllib.error.HTTPError:  # an answer, if not a welcome one: something serves there
            outcome.append(None)
        except (OSError, ValueError, http.client.HTTPException) as error:  # URLError is an OSError
            reason = getattr(error, "reason", error)
            outcome.append(str(getattr(reason, "strerror", None) or reason or type(error).__name__))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(REACH_TIMEOUT_S)
    return outcome[0] if outcome else f"no answer within {REACH_TIMEOUT_S:g} s"


def _never_fatal(what: str, warn: Callable[[str], None], log: Callable[[], str | None]) -> str | None:
    """Runs `log`; a failure of any kind is one warning line, never an error of the run."""
    try:
        return log()
    except Exception as error:  # W&B raises many types (network, service, filesystem); all mean "not logged"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warn(f"W&B logging of {what} failed, the results on disk are complete: {type(error).__name__}"
             + (f": {reason}" if reason else ""))
        return None


@dataclass
class LineSeries:
    """One chart of several named lines, each a list of (x, y) points."""

    title: str
    xname: str
    yname: str
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def log_run(mode: str, run_dir: Path, run_id: str, config: dict, metrics: dict, records: list[dict],
            warn: Callable[[str], None]) -> str | None:
    """Log config, summary metrics and the per-sample table; returns where W&B wrote, if anywhere.
    Call it once the results are on disk: a failure is one `warn` line."""
    if mode == "off":
        return None
    return _never_fatal(f"run {run_id}", warn, lambda: _log_run(mode, run_dir, run_id, config, metrics, records))


def _wandb():
    """The wandb package. Imported only when something is logged: it is slow to import, and a run or sweep
    with W&B off never needs it."""
    import wandb

    return wandb


def _log_run(mode: str, run_dir: Path, run_id: str, config: dict, metrics: dict, records: list[dict]) -> str:
    wandb = _wandb()
    # The group, when a sweep runs this, comes from WANDB_RUN_GROUP (set by the sweep, read by W&B).
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "evalkit"), name=run_id, id=run_id,
                     config=config, dir=str(run_dir), mode=mode, resume="allow", reinit="finish_previous",
                     settings=wandb.Settings(silent=True))
    logged = {"predictions": _table(records)}
    if "by_turn" in metrics:  # a multi-turn task: quality by turn index
        turns = _table(metrics["by_turn"])
        logged.update({"by_turn": turns, "score_by_turn": wandb.plot.line(turns, "turn", "score",
                                                                           title="score by turn")})
    run.log(logged)
    run.summary.update(metrics)
    where = run.dir
    run.finish()
    return where


def log_sweep(mode: str, sweep_dir: Path, sweep_id: str, config: dict, rows: list[dict],
              charts: dict[str, LineSeries], summary: dict, warn: Callable[[str], None]) -> str | None:
    """The sweep-level run, in the same group as its cells: the cells table, one line chart per entry
    of `charts` (quality or memory against budget, one line per policy) and summary numbers. A failure
    is one `warn` line."""
    if mode == "off":
        return None
    return _never_fatal(f"sweep {sweep_id}", warn,
                        lambda: _log_sweep(mode, sweep_dir, sweep_id, config, rows, charts, summary))


def _log_sweep(mode: str, sweep_dir: Path, sweep_id: str, config: dict, rows: list[dict],
               charts: dict[str, LineSeries], summary: dict) -> str:
    wandb = _wandb()
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
    columns = sorted({key for record in records for key in record})
    rows = [[_cell(r.get(c)) for c in columns] for r in records]
    for i in range(len(columns)):  # W&B wants one type per column: a mixed column becomes text
        if len({type(row[i]) for row in rows if row[i] is not None}) > 1:
            for row in rows:
                row[i] = None if row[i] is None else str(row[i])
    return _wandb().Table(columns=columns, data=rows)


def _cell(value):
    """W&B tables hold scalars; lists and dicts (references, meta) go in as JSON text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value, default=str)
