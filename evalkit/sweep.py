"""`evalkit sweep`: policies × budgets × tasks × lengths, one run per cell, in-process or on Ray.

A cell is one RunConfig and one `runner.run`, keyed by its run id, so the results store
gives crash safety for free: a complete run folder (metrics.json present) is skipped and a
partial one resumes sample by sample. Every (task, length) also gets its full-cache
baseline (policy `full`, budget 1), computed once and shared by all cells of that setting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from evalkit.config import RunConfig

ENGINES = ("local", "ray")
# Environment a Ray worker needs to behave like this process (offline hub, W&B mode and group, caches).
_WORKER_ENV_PREFIXES = ("HF_", "WANDB_", "EVALKIT_", "TRANSFORMERS_", "TRITON_")


@dataclass
class Cell:
    config: RunConfig
    baseline: bool

    @property
    def run_id(self) -> str:
        return self.config.run_id()

    def label(self) -> str:
        return f"{self.config.task} @ {self.config.length}: {self.config.policy} @ {self.config.budget}"


@dataclass
class Plan:
    cells: list[Cell]
    settings: dict  # the resolved sweep settings, as recorded in sweep.json and W&B
    out: str
    engine: str
    ray_address: str | None

    @property
    def sweep_id(self) -> str:
        digest = hashlib.sha256("\n".join(sorted(c.run_id for c in self.cells)).encode()).hexdigest()[:8]
        return f"sweep-{digest}"


def register(app: typer.Typer) -> None:
    """Adds `evalkit sweep` to the command line."""
    app.command("sweep")(sweep)


def sweep(
    ctx: typer.Context,
    config_file: Optional[Path] = typer.Option(None, "--config", help="YAML, TOML or JSON file of these options "
                                               "(keys as the option names); flags given here override it."),
    policies: str = typer.Option("h2o_head,h2o_token,h2o_page,snapkv", help="Comma-separated policies."),
    budgets: str = typer.Option("0.1,0.2,0.5", help="Comma-separated budgets: fractions in (0, 1] or token counts."),
    tasks: str = typer.Option("ruler:niah_single_2", help="Comma-separated tasks."),
    length: str = typer.Option("2048", help="Prompt + answer tokens per sample; comma-separated for several."),
    samples: Optional[int] = typer.Option(None, help="Samples per cell (default 10); data tasks take --limit."),
    task_arg: list[str] = typer.Option([], help="Task setting KEY=VALUE for every task (repeatable)."),
    data_format: Optional[str] = typer.Option(None, "--format",
                                              help="Data tasks: kvpress, ruler, longbench or auto."),
    metric: Optional[str] = typer.Option(None, help="Data tasks: the metric (default: the format's own)."),
    limit: Optional[int] = typer.Option(None, help="Data tasks: at most this many records (default: all)."),
    offset: Optional[int] = typer.Option(None, help="Data tasks: skip this many records first (default 0)."),
    model: str = typer.Option("smollm2-135m", help="Embedded default, a local folder or a Hugging Face model id."),
    layout: str = typer.Option("paged", help="KV storage: paged or dense."),
    block_size: int = typer.Option(16, help="Tokens per page."),
    granularity: Optional[str] = typer.Option(None, help="Override every policy's granularity: head, head_page, "
                                                         "token or page."),
    policy_arg: list[str] = typer.Option([], help="Policy hyper-parameter KEY=VALUE for every policy (repeatable; "
                                                  "not the full-cache baseline)."),
    prefill: str = typer.Option("full", help="full or chunked."),
    chunk_size: int = typer.Option(512, help="Tokens per chunk with --prefill chunked."),
    query_aware: bool = typer.Option(True, "--query-aware/--query-agnostic",
                                     help="Compress with the question in the prompt, or before it is seen."),
    decode_eviction: bool = typer.Option(True, "--decode-eviction/--no-decode-eviction",
                                         help="Keep the cache at budget while decoding, or let it grow."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(0, help="Seed for samples, random policies and sampling."),
    batch_size: int = typer.Option(1, help="Prompts per generation batch."),
    pool_pages: Optional[int] = typer.Option(None, help="Pages per layer's pool (default: what the batch needs)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    out: str = typer.Option("runs", "--out", help="Results folder (shared with `evalkit run`)."),
    wandb: str = typer.Option("auto", help="auto (online only with credentials), off, offline, online."),
    kernels: str = typer.Option("auto", help="Attention: auto (Triton kernels on CUDA, torch elsewhere), "
                                             "triton, torch."),
    engine: str = typer.Option("local", help="local: cells one after another in this process; ray: one Ray task "
                               "per cell (one GPU each where the cluster has GPUs)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: start a local instance)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the cells and what is already done; run nothing."),
):
    """Run a grid of policies × budgets × tasks (× lengths) plus each full-cache baseline; resumable."""
    from rich.console import Console

    plan = make_plan(_resolve_settings(ctx, config_file))
    stdout, stderr = Console(), Console(stderr=True)
    if dry_run:
        _print_plan(plan, stdout)
        return
    run_plan(plan, stderr)
    _print_grid(plan, stdout)


# ---- settings: defaults <- config file <- command-line flags ------------------------------------------

_GRID_KEYS = ("policies", "budgets", "tasks", "length")
_NOT_SETTINGS = ("config_file", "dry_run")


def _resolve_settings(ctx: typer.Context, config_file: Path | None) -> dict:
    from evalkit.errors import EvalkitError

    params = {p.name: p for p in ctx.command.params if p.name not in _NOT_SETTINGS}
    settings = {name: value for name, value in ctx.params.items() if name in params}
    if config_file is None:
        return settings
    from evalkit.config import RunConfig

    # A file key is a flag's name (`format`, `block-size`) or its parameter's (`data_format`, `block_size`).
    by_flag = {opt.lstrip("-").replace("-", "_"): name for name, p in params.items() for opt in p.opts}
    spelled = {"task_args": "task_arg", "policy_args": "policy_arg"}  # RunConfig's names -> the flags'
    extra_fields = {f.name for f in fields(RunConfig)} - set(params) - {"policy", "budget", "task", *spelled}
    for key, value in read_config_file(config_file).items():
        name = key.replace("-", "_")
        name = spelled.get(name, by_flag.get(name, name))
        if name in spelled.values() and isinstance(value, dict):  # KEY=VALUE settings as a mapping
            value = [f"{k}={v}" for k, v in value.items()]
        if name in params:
            if ctx.get_parameter_source(name).name != "DEFAULT":  # a flag on the command line wins
                continue
            if name in _GRID_KEYS and isinstance(value, list):
                value = ",".join(str(item) for item in value)
            try:  # the flag's own type converts and checks the file's value
                settings[name] = params[name].process_value(ctx, value)
            except typer.BadParameter as error:
                raise EvalkitError(f"config file {config_file}: {key}: {error.message}") from None
        elif name in extra_fields:  # RunConfig fields without a flag pass through as written
            settings[name] = value
        else:
            known = sorted({*by_flag, *extra_fields, *spelled})
            raise EvalkitError(f"config file {config_file}: unknown key {key!r}; known: {', '.join(known)}")
    return settings


def read_config_file(path: Path) -> dict:
    """A mapping from a .yaml/.yml, .toml or .json file; anything unreadable is one clear error."""
    from evalkit.errors import EvalkitError

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise EvalkitError(f"cannot read config file {path}: {error.strerror or error}") from None
    suffix = Path(path).suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise EvalkitError(f"config file {path}: unknown format {suffix or '(no suffix)'!r}; "
                               "use .yaml, .yml, .toml or .json")
    except EvalkitError:
        raise
    except Exception as error:  # each parser has its own error type; all mean "not valid <format>"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise EvalkitError(f"cannot parse config file {path}: {reason}") from None
    if not isinstance(data, dict):
        raise EvalkitError(f"config file {path} must hold a mapping of option names to values")
    return data


def _split(value, flag: str) -> list[str]:
    from evalkit.errors import EvalkitError

    items = [item.strip() for item in str(value).split(",") if item.strip()]
    if not items:
        raise EvalkitError(f"--{flag} is empty: give a comma-separated list")
    return items


# ---- the plan -------------------------------------------------------------------------------------------

def make_plan(settings: dict) -> Plan:
    """Every cell, validated, before anything runs: bad input never leaves a half-run grid."""
    from evalkit.config import RunConfig, parse_budget, parse_policy_args, parse_task_args
    from evalkit.errors import EvalkitError
    from evalkit.models import model_source
    from evalkit.tasks.custom import is_data_task

    settings = dict(settings)
    policies = _split(settings.pop("policies"), "policies")
    budgets = [parse_budget(b) for b in _split(settings.pop("budgets"), "budgets")]
    tasks = _split(settings.pop("tasks"), "tasks")
    lengths = []
    for item in _split(settings.pop("length"), "length"):
        if not item.isdigit():
            raise EvalkitError(f"--length takes whole numbers of tokens, got {item!r}")
        lengths.append(int(item))
    engine, ray_address = settings.pop("engine"), settings.pop("ray_address")
    if engine not in ENGINES:
        raise EvalkitError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    task_args, policy_args = parse_task_args(settings.pop("task_arg")), parse_policy_args(settings.pop("policy_arg"))
    base = {k: v for k, v in settings.items() if v is not None or k not in _UNSET_MEANS_DEFAULT}
    base["task_args"], base["policy_args"] = task_args, policy_args
    model_source(base["model"])  # a missing local model is refused before the first cell
    _refuse_unused(base, tasks)

    cells: dict[str, Cell] = {}
    for task in tasks:
        # --samples sizes registered tasks; --limit/--offset/--format/--metric select from data files.
        unused = _DATA_OPTIONS if not is_data_task(task) else ("samples",)
        for length in lengths:
            grid = [("full", 1.0, True)] + [(p, b, False) for p in policies for b in budgets]
            for policy, budget, is_baseline in grid:
                fields_here = {k: v for k, v in base.items() if k not in unused}
                if is_baseline:  # the full cache, as it is
                    fields_here["granularity"], fields_here["policy_args"] = None, {}
                config = RunConfig(**fields_here, policy=policy, budget=budget, task=task, length=length).validate()
                cells.setdefault(config.run_id(), Cell(config, is_baseline))
    grid = [c.config for c in cells.values() if not c.baseline]
    resolved = {"policies": list(dict.fromkeys(c.policy for c in grid)), "budgets": budgets,  # canonical names
                "tasks": list(dict.fromkeys(c.config.task for c in cells.values())), "lengths": lengths, **base}
    return Plan(list(cells.values()), resolved, base["out"], engine, ray_address)


_DATA_OPTIONS = ("data_format", "metric", "limit", "offset")
_UNSET_MEANS_DEFAULT = ("samples", *_DATA_OPTIONS)  # None: RunConfig's own default


def _refuse_unused(base: dict, tasks: list[str]) -> None:
    """An option that applies to none of the grid's tasks is a mistake, as it is for `evalkit run`."""
    from evalkit.errors import EvalkitError
    from evalkit.tasks.custom import is_data_task

    flags = {"data_format": "format", "metric": "metric", "limit": "limit", "offset": "offset"}
    if not any(is_data_task(t) for t in tasks):
        for name, flag in flags.items():
            if base.get(name) is not None:
                raise EvalkitError(f"--{flag} is for data tasks (jsonl:PATH, hf:NAME[:CONFIG]:SPLIT), and none of "
                                   f"{', '.join(tasks)} is one")
    if base.get("samples") is not None and all(is_data_task(t) for t in tasks):
        raise EvalkitError("--samples is not for data tasks: they run every record in "
                           "[--offset, --offset + --limit); use --limit N")


def _state(plan: Plan, cell: Cell) -> str:
    from evalkit.results import RunDir

    run_dir = RunDir(plan.out, cell.run_id)
    if run_dir.complete:
        return "done"
    if run_dir.predictions_path.exists():
        return f"partial ({len(run_dir.predictions())} samples)"
    return "to run"


def _print_plan(plan: Plan, console) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{plan.sweep_id}: {len(plan.cells)} cells", title_justify="left")
    for column in ("run id", "task", "length", "policy", "budget", "state"):
        table.add_column(column)
    for cell in plan.cells:
        c = cell.config
        table.add_row(cell.run_id, c.task, str(c.length), c.policy + (" (baseline)" if cell.baseline else ""),
                      str(c.budget), _state(plan, cell))
    Console(file=console.file, width=max(console.width, 140)).print(table)  # run ids are long: never cut them


# ---- running ----------------------------------------------------------------------------------------------

def run_plan(plan: Plan, console) -> None:
    """Runs every cell that is not complete, then logs the sweep to W&B; rerunning resumes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from evalkit.results import RunDir, check_writable_folder, write_json_atomic
    from evalkit.runner import one_line
    from evalkit.tracking import decide_wandb_mode

    check_writable_folder(plan.out, "--out")
    say = one_line(console)
    mode = decide_wandb_mode(plan.settings["wandb"], lambda line: say(f"note: {line}"))
    for cell in plan.cells:  # decided once here, before any work, so no cell can be refused for W&B later
        cell.config.wandb = mode
    sweep_dir = Path(plan.out) / "_sweeps" / plan.sweep_id
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(sweep_dir / "sweep.json", {"sweep_id": plan.sweep_id, "settings": plan.settings,
                                                 "cells": [_cell_summary(c) for c in plan.cells]})
    todo = [cell for cell in plan.cells if not RunDir(plan.out, cell.run_id).complete]
    progress = Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console)
    with progress, _wandb_group(plan.sweep_id if mode != "off" else None):
        bar = progress.add_task("", total=len(plan.cells), completed=len(plan.cells) - len(todo))
        if plan.engine == "ray":
            _run_on_ray(plan, todo, console, progress, bar)
        else:
            _run_local(todo, console, progress, bar)
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


def _run_local(cells: list[Cell], console, progress, bar) -> None:
    from evalkit.runner import run

    for cell in cells:
        progress.update(bar, description=cell.label())
        run(cell.config, console, wandb_mode=cell.config.wandb)
        progress.advance(bar)
    progress.update(bar, description="")


def _run_on_ray(plan: Plan, cells: list[Cell], console, progress, bar) -> None:
    """One Ray task per cell. Workers run in their own scratch space and send the run folder back,
    so the driver's results store fills the same way whether the cluster shares its disk or not."""
    import logging

    import ray

    from evalkit.errors import EvalkitError

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


def run_cell_in_worker(config_fields: dict, partial: dict[str, bytes]) -> dict[str, bytes]:
    """Runs one cell in a scratch folder (seeded with a partial run to resume) and returns the
    run folder's files, relative path -> bytes."""
    import tempfile

    from rich.console import Console

    from evalkit.config import RunConfig
    from evalkit.runner import run

    with tempfile.TemporaryDirectory(prefix="evalkit-cell-") as scratch:
        config = RunConfig(**{**config_fields, "out": scratch})
        folder = Path(scratch) / config.run_id()
        folder.mkdir()
        for name, data in partial.items():
            (folder / name).write_bytes(data)
        run(config, Console(stderr=True, quiet=True), wandb_mode=config.wandb)
        files = {}
        for root, _, names in os.walk(folder):  # symlinks (W&B's latest-run) are not files to copy
            for name in names:
                path = Path(root) / name
                if not path.is_symlink():
                    files[str(path.relative_to(folder))] = path.read_bytes()
        return files


def _partial_files(out: str, cell: Cell) -> dict[str, bytes]:
    """A partial run's config and predictions, for a worker to resume (its runner cuts a torn last line)."""
    from evalkit.results import RunDir

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
    from evalkit.results import RunDir, write_json_atomic

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


# ---- what a sweep reports -----------------------------------------------------------------------------

def _cell_summary(cell: Cell) -> dict:
    c = cell.config
    return {"run_id": cell.run_id, "task": c.task, "length": c.length, "policy": c.policy, "budget": c.budget,
            "baseline": cell.baseline}


def sweep_rows(plan: Plan) -> list[dict]:
    """One row per complete non-baseline cell: its numbers and its score relative to the full cache."""
    from evalkit.report import budget_fraction
    from evalkit.results import RunDir

    baselines = {}
    for cell in plan.cells:
        if cell.baseline and RunDir(plan.out, cell.run_id).complete:
            baselines[(cell.config.task, cell.config.length)] = RunDir(plan.out, cell.run_id).metrics()
    rows = []
    for cell in plan.cells:
        run_dir = RunDir(plan.out, cell.run_id)
        if cell.baseline or not run_dir.complete:
            continue
        m, c = run_dir.metrics(), cell.config
        base = baselines.get((c.task, c.length))
        rows.append({
            "run_id": cell.run_id, "task": c.task, "length": c.length, "policy": c.policy, "budget": c.budget,
            "budget_fraction": budget_fraction(c.budget, m), "score": m["score"],
            "full_cache_score": base["score"] if base else None,
            "relative_score": m["score"] / base["score"] if base and base["score"] else None,
            "held_over_full": m["held_over_full"], "bytes_held": m["bytes_held"], "kept_tokens": m["kept_tokens"],
            "prefill_tokens_per_s": m["prefill_tokens_per_s"], "decode_tokens_per_s": m["decode_tokens_per_s"],
        })
    return rows


def _log_sweep(plan: Plan, mode: str, sweep_dir: Path, warn) -> None:
    """One sweep-level W&B run: the cells table, quality- and memory-vs-budget lines per task, AUCs."""
    from evalkit.report import quality_auc
    from evalkit.tracking import LineSeries, log_sweep

    rows = sweep_rows(plan)
    charts, summary = {}, {}
    for task in plan.settings["tasks"]:
        for length in plan.settings["lengths"]:
            here = [r for r in rows if r["task"] == task and r["length"] == length]
            if not here:
                continue
            setting = re.sub(r"[^\w.-]+", "-", f"{task}-{length}")  # a W&B key and a file name
            quality = LineSeries(f"quality vs budget: {setting}", "budget", "score")
            memory = LineSeries(f"KV held / full vs budget: {setting}", "budget", "KV held / full")
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
    log_sweep(mode, sweep_dir, plan.sweep_id, plan.settings, rows, charts, summary, warn)


def _print_grid(plan: Plan, console) -> None:
    """Score per policy (rows) and budget (columns), one table per task and length."""
    from rich.table import Table

    rows = sweep_rows(plan)
    for task in plan.settings["tasks"]:
        for length in plan.settings["lengths"]:
            here = [r for r in rows if r["task"] == task and r["length"] == length]
            if not here:
                continue
            full = here[0]["full_cache_score"]
            console.print(f"[bold]{task} @ {length}[/]: score %, full cache "
                          + (f"{100 * full:.1f}" if full is not None else "not run"), highlight=False)
            table = Table()
            table.add_column("policy")
            budgets = list(dict.fromkeys(r["budget"] for r in here))
            for budget in budgets:
                table.add_column(str(budget), justify="right")
            for policy in dict.fromkeys(r["policy"] for r in here):
                by_budget = {r["budget"]: r["score"] for r in here if r["policy"] == policy}
                table.add_row(policy, *(f"{100 * by_budget[b]:.1f}" if b in by_budget else "" for b in budgets))
            console.print(table)
    console.print(f"results: {plan.out}  (report: evalkit report {plan.out})")
