"""Running a sweep's cells: in this process (cells that share their samples together, one prefill
per sample), or one Ray task per cell; then the
sweep's own W&B run. A Ray worker runs its cell in a scratch folder and sends the run folder's files
back, so the results store is written by this process only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.integrations import wandb as wandb_mirror
from evalkit.report.leaderboard import quality_auc
from evalkit.results import FolderBusy, RunDir, check_writable_folder, write_json_atomic
from evalkit.runner import one_line, run, run_many
from evalkit.sweep.plan import SweepCell, SweepPlan, cell_summary, prefill_groups, sweep_rows

# Environment a Ray worker needs to behave like this process (offline hub, W&B mode and group, caches).
_WORKER_ENV_PREFIXES = ("HF_", "WANDB_", "EVALKIT_", "TRANSFORMERS_", "TRITON_")


def run_sweep(plan: SweepPlan, console) -> None:
    """Runs every cell that is not complete, then logs the sweep to W&B; rerunning resumes."""
    check_writable_folder(plan.out, "--out")
    if plan.engine == "ray":
        _import_ray(plan.ray_address)  # a missing package is bad input: refused before anything is written
    say = one_line(console)
    mode = wandb_mirror.decide_wandb_mode(plan.settings["wandb"], lambda line: say(f"note: {line}"))
    for cell in plan.cells:  # decided once here, before any work, so no cell can be refused for W&B later
        cell.config.wandb = mode
    sweep_dir = Path(plan.out) / "_sweeps" / plan.sweep_id
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(sweep_dir / "sweep.json", {"sweep_id": plan.sweep_id, "settings": plan.settings,
                                                 "cells": [cell_summary(c) for c in plan.cells]})
    todo = [cell for cell in plan.cells if not RunDir(plan.out, cell.run_id).complete]
    progress = Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console)
    with progress, _wandb_group(plan.sweep_id if mode != "off" else None):
        bar = progress.add_task("", total=len(plan.cells), completed=len(plan.cells) - len(todo))
        if plan.engine == "ray":
            _run_on_ray(plan, todo, console, progress, bar)
        else:
            _run_local(plan, todo, console, progress, bar)
    if mode != "off":
        trouble: list[str] = []
        with console.status("logging the sweep to W&B"):  # lines printed under a status can be lost: said after
            _log_sweep(plan, mode, sweep_dir, trouble.append)
        for line in trouble:
            say(f"warning: {line}")


@contextlib.contextmanager
def _wandb_group(group: str | None):
    """Groups the cells' W&B runs under the sweep (W&B reads WANDB_RUN_GROUP); restored afterwards."""
    previous = os.environ.get("WANDB_RUN_GROUP")
    if group:
        os.environ["WANDB_RUN_GROUP"] = group
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("WANDB_RUN_GROUP", None)
        else:
            os.environ["WANDB_RUN_GROUP"] = previous


def _run_local(plan: SweepPlan, cells: list[SweepCell], console, progress, bar) -> None:
    """Cells that share a prefill run together (`runner.run_many`: one prefill per sample for all). A group
    with a folder another process holds (two sweeps sharing a full-cache cell) is passed over until the
    others are done; only when nothing else is left does the sweep wait for it."""
    say = one_line(console)
    todo = {cell.run_id for cell in cells}
    pending = [group for group in ([c for c in group if c.run_id in todo] for group in prefill_groups(plan)) if group]
    first_pass = True  # later passes retry only groups held in the first, already said
    while pending:
        held = []
        for group in pending:
            try:
                _run_cells(group, console, progress, bar, wait=len(pending) == 1)
            except FolderBusy:
                held.append(group)
                if first_pass:
                    say(f"note: another evalkit process holds a folder of {_label(group)}: after the rest")
        if held and len(held) == len(pending):  # nothing else could run: wait for the first
            _run_cells(held.pop(0), console, progress, bar, wait=True)
        pending, first_pass = held, False
    progress.update(bar, description="")


def _run_cells(group: list[SweepCell], console, progress, bar, wait: bool) -> None:
    progress.update(bar, description=_label(group))
    run_many([cell.run for cell in group], console, wandb_mode=group[0].config.wandb, mirror=wandb_mirror,
             wait=wait)
    progress.advance(bar, len(group))


def _label(group: list[SweepCell]) -> str:
    first = group[0]
    return first.label() if len(group) == 1 else \
        f"{first.config.task} @ {first.config.length}: {len(group)} cells, one prefill per sample"


def _run_on_ray(plan: SweepPlan, cells: list[SweepCell], console, progress, bar) -> None:
    """One Ray task per cell. Workers run in their own scratch space and send the run folder back,
    so the driver's results store fills the same way whether the cluster shares its disk or not."""
    ray = _import_ray(plan.ray_address)
    env = {k: v for k, v in os.environ.items() if k.startswith(_WORKER_ENV_PREFIXES)}
    started_here = not ray.is_initialized()
    if started_here:
        with console.status("starting Ray" if plan.ray_address is None else f"joining Ray at {plan.ray_address}"):
            ray.init(address=plan.ray_address, runtime_env={"env_vars": env}, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR)
    pending = {}
    try:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0)(run_cell_in_worker)
        pending = {task.remote(cell.config.to_dict(), _partial_files(plan.out, cell)): cell for cell in cells}
        progress.update(bar, description=f"{len(pending)} cells on Ray")
        while pending:
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(ready)
            try:
                files = ray.get(ready)
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, EvalkitError):  # bad input found inside a worker: same one line
                    raise EvalkitError(f"{cell.label()}: {error.cause}") from None
                raise
            store_cell_files(plan.out, cell.run_id, files)
            progress.advance(bar)
            progress.update(bar, description=f"{len(pending)} cells on Ray" if pending else "")
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


def _import_ray(address: str | None):
    """The `ray` module, or one line naming the package to install. An address with a scheme (`ray://`;
    RAY_ADDRESS stands in for none or `auto`, as in `ray.init`) goes through Ray Client, which needs
    more than the minimal `ray`: grpcio, all that Ray's `client` extra adds. (No square brackets in the
    message: the CLI prints it as rich markup.) Both are optional packages, imported only here."""
    try:
        import ray
    except ImportError:
        raise EvalkitError("--engine ray needs the package ray: pip install ray") from None
    if address in (None, "auto"):
        address = os.environ.get("RAY_ADDRESS") or address
    if address and "://" in address:
        try:
            import grpc  # noqa: F401  (what ray.init checks for Ray Client)
        except ImportError:
            raise EvalkitError(f"the Ray address {address} is reached through Ray Client, which needs the "
                               f"package grpcio (Ray's client extra): pip install grpcio") from None
    return ray


def run_cell_in_worker(config_fields: dict, partial: dict[str, bytes]) -> dict[str, bytes]:
    """Runs one cell in a scratch folder (seeded with a partial run to resume) and returns the
    run folder's files, relative path -> bytes."""
    with tempfile.TemporaryDirectory(prefix="evalkit-cell-") as scratch:
        config = RunConfig(**{**config_fields, "out": scratch})
        folder = Path(scratch) / config.run_id()
        folder.mkdir()
        for name, data in partial.items():
            (folder / name).write_bytes(data)
        run(config, Console(stderr=True, quiet=True), wandb_mode=config.wandb, mirror=wandb_mirror)
        files = {}
        for root, _, names in os.walk(folder):  # symlinks (W&B's latest-run) are not files to copy
            for name in names:
                path = Path(root) / name
                if not path.is_symlink():
                    files[str(path.relative_to(folder))] = path.read_bytes()
        return files


def _partial_files(out: str, cell: SweepCell) -> dict[str, bytes]:
    """A partial run's config and predictions, for a worker to resume (its runner cuts a torn last line)."""
    run_dir = RunDir(out, cell.run_id)
    if run_dir.complete or not run_dir.config_path.exists():
        return {}
    files = {"config.json": run_dir.config_path.read_bytes()}
    if run_dir.predictions_path.exists():
        files["predictions.jsonl"] = run_dir.predictions_path.read_bytes()
    return files


def store_cell_files(out: str, run_id: str, files: dict[str, bytes]) -> None:
    """Writes a worker's run folder into the store: every file atomically, metrics.json (the mark of
    a complete run) last, so a driver killed midway leaves a partial run that resumes."""
    run_dir = RunDir(out, run_id)
    files = dict(files)
    metrics = files.pop("metrics.json")
    provenance = json.loads(files.pop("config.json"))
    provenance["config"]["out"] = out  # the worker ran in scratch space; record where the result lives
    with run_dir.locked():
        write_json_atomic(run_dir.config_path, provenance)
        for name, data in files.items():
            _write_bytes_atomic(run_dir.path / name, data)
        _write_bytes_atomic(run_dir.metrics_path, metrics)


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _log_sweep(plan: SweepPlan, mode: str, sweep_dir: Path, warn) -> None:
    """One sweep-level W&B run: the cells table, quality- and memory-vs-budget lines per task, AUCs."""
    rows = sweep_rows(plan)
    charts, summary = {}, {}
    for task in plan.settings["tasks"]:
        for length in plan.settings["lengths"]:
            here = [r for r in rows if r["task"] == task and r["length"] == length]
            if not here:
                continue
            setting = re.sub(r"[^\w.-]+", "-", f"{task}-{length}")  # a W&B key and a file name
            quality = wandb_mirror.LineSeries(f"quality vs budget: {setting}", "budget", "score")
            memory = wandb_mirror.LineSeries(f"KV held / full vs budget: {setting}", "budget", "KV held / full")
            lowest, full = min(r["budget_fraction"] for r in here), here[0]["full_cache_score"]
            for policy in dict.fromkeys(r["policy"] for r in here):
                points = sorted((r for r in here if r["policy"] == policy), key=lambda r: r["budget_fraction"])
                quality.lines[policy] = [(r["budget_fraction"], r["score"]) for r in points]
                memory.lines[policy] = [(r["budget_fraction"], r["held_over_full"]) for r in points]
                auc = quality_auc(quality.lines[policy], lowest, full)
                if auc is not None:
                    summary[f"auc/{setting}/{policy}"] = auc
            if full is not None:
                quality.lines["full cache"] = [(lowest, full), (1.0, full)]
            charts[f"quality_vs_budget/{setting}"] = quality
            charts[f"memory_vs_budget/{setting}"] = memory
            for scorer in dict.fromkeys(r["scorer"] for r in here):  # W&B groups a scorer's granularities
                by_granularity = wandb_mirror.LineSeries(f"{scorer} by granularity: {setting}", "budget", "score")
                policies = {r["policy"]: r["granularity"] for r in here if r["scorer"] == scorer}
                for policy, granularity in policies.items():  # a line per granularity, or per variant of one
                    alone = list(policies.values()).count(granularity) == 1
                    by_granularity.lines[granularity if alone else policy] = quality.lines[policy]
                charts[f"granularities/{setting}/{scorer}"] = by_granularity
    wandb_mirror.log_sweep(mode, sweep_dir, plan.sweep_id, plan.settings, rows, charts, summary, warn)
