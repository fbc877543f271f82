"""Evaluations: a task's samples through the generation loop under one policy and budget (`run`),
or under several at once sharing each sample's prefill (`run_many`: a sweep's runs, a run and
its full-cache baseline), each run in its own folder as if it had run alone.

Everything that can be refused is refused before the run folder exists; a run
folder that exists is resumed, sample by sample, by one process at a time (the
folder's lock: a second process on it waits). Results are on disk before W&B
is told anything, so W&B can never cost one (the W&B mirror is handed in by the
caller, `mirror=evalkit.integrations.wandb`: the runner imports no tool). What a sample goes
through is `evaluations`' (answers generated and scored by the task, a multi-turn conversation, a
passage's perplexity). A task with `write_artifacts` (the niah grid's heatmap) writes its files into
the run folder when the run finishes.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from evalkit.config import ResolvedRun, RunConfig, baseline_for, fields_where
from evalkit.errors import EvalkitError
from evalkit.evaluations import evaluation_for
from evalkit.loop import GenerationSettings
from evalkit.models import load_model
from evalkit.results import RunDir, check_writable_folder, complete_runs, package_versions, read_json
from evalkit.tasks.ppl import Perplexity

_PACKAGES = ("evalkit", "torch", "transformers", "triton", "datasets", "wandb")


@dataclass
class RunResult:
    run_id: str
    path: str
    metrics: dict
    baseline: dict | None  # metrics of the matching full-cache run, if one is on disk
    resumed_from: int  # samples found already done


class Mirror(Protocol):
    """Where a finished run is mirrored once its results are on disk: `evalkit.integrations.wandb`."""

    def decide_wandb_mode(self, requested: str, say: Callable[[str], None]) -> str: ...

    def log_run(self, mode: str, run_dir: Path, run_id: str, config: dict, metrics: dict, records: list[dict],
                warn: Callable[[str], None]) -> str | None: ...


def run(config: RunConfig | ResolvedRun, console: Console | None = None, wandb_mode: str | None = None,
        mirror: Mirror | None = None) -> RunResult:
    """`wandb_mode`: the W&B mode already decided (a sweep decides once for its runs); None: decided
    here from `config.wandb`. `mirror`: the W&B mirror (`evalkit.integrations.wandb`, as `evalkit run`,
    `sweep` and `lm-eval` pass it); without one nothing is mirrored, and a W&B mode other than off or
    auto is refused."""
    return run_many([config], console, wandb_mode, mirror)[0]


def run_many(runs: list[RunConfig | ResolvedRun], console: Console | None = None, wandb_mode: str | None = None,
             mirror: Mirror | None = None, wait: bool = True, baselines: bool = False) -> list[RunResult]:
    """Several runs; those that differ only in what happens after a full prefill (policy, budget,
    granularity, layout, ...) prefill each sample once and fork it (`shared_prefill.SharedPrefill`), the
    rest run one after another. Each run's folder ends exactly as `run` alone would leave it. A folder
    another process holds is waited for, or with `wait=False` raises FolderBusy before its group runs
    (the groups before it are done). A RunConfig is resolved here; a ResolvedRun (`evalkit run`, a sweep's
    cells) is used as it is. With `baselines`, a run whose full-cache baseline is not stored makes it too
    (`ResolvedRun.full_cache`), in the same prefill group."""
    console = console or Console(stderr=True)
    resolved = [run if isinstance(run, ResolvedRun) else run.resolve() for run in runs]
    configs = [run.config for run in resolved]
    if baselines:
        stored = complete_runs(configs[0].out)
        resolved += [run.full_cache() for run in resolved
                     if run.config.policy != "full" and find_baseline(run.config, stored) is None]
    say = one_line(console)
    results: dict[str, RunResult] = {}
    todo: dict[str, ResolvedRun] = {}  # by run id: a run asked for twice runs once
    for run in resolved:
        run_id = run.config.run_id()
        run_dir = RunDir(run.config.out, run_id)
        if run_dir.complete:
            results[run_id] = RunResult(run_id, str(run_dir.path), run_dir.metrics(), None, -1)
        else:
            check_writable_folder(run.config.out, "--out")
            todo.setdefault(run_id, run)
    if todo:
        mode = _wandb_mode(next(iter(todo.values())).config, wandb_mode, mirror, say)
        groups: dict[tuple, list[ResolvedRun]] = {}
        for run_id, run in todo.items():
            groups.setdefault(prefill_key(run.config) or (run_id,), []).append(run)
        for group in groups.values():
            results.update(zip([run.config.run_id() for run in group], _run_group(group, mode, mirror, console, wait)))
    # Baselines looked up last (a run's full-cache baseline may be one of the runs just made), reading
    # each results store once for all the runs: a sweep's group is dozens of runs.
    stores = {config.out: complete_runs(config.out) for config in configs}
    return [replace(results[config.run_id()], baseline=find_baseline(config, stores[config.out]))
            for config in configs]


def prefill_key(config: RunConfig) -> tuple | None:
    """What a run's prefill depends on: runs with the same key share one (perplexity: stream the same passages
    together, `score_rolling_branches`); None when it cannot be shared (a chunked prefill streams through the
    policy's own cache)."""
    if config.prefill != "full" and config.task != Perplexity.name:
        return None
    after_prefill = fields_where(after_prefill=True)
    return tuple(sorted((k, repr(v)) for k, v in config.to_dict().items() if k not in after_prefill))


def _wandb_mode(config: RunConfig, decided: str | None, mirror: Mirror | None, say: Callable[[str], None]) -> str:
    if mirror is None:
        requested = decided or config.wandb
        if requested not in ("off", "auto"):
            raise EvalkitError(f"wandb={requested!r} needs a mirror: runner.run(..., "
                               "mirror=evalkit.integrations.wandb)")
        return "off"
    return decided or mirror.decide_wandb_mode(config.wandb, lambda line: say(f"note: {line}"))


@dataclass
class _RunInProgress:
    """One run of a group: its folder, its generation settings and what it has recorded so far."""

    config: RunConfig
    run_dir: RunDir
    settings: GenerationSettings
    provenance: dict
    records: list[dict]
    noted: bool = False  # this process's machine is in config.json

    @property
    def done(self) -> set:
        return {record["id"] for record in self.records}


def _run_group(runs: list[ResolvedRun], mode: str, mirror: Mirror | None, console: Console,
               wait: bool) -> list[RunResult]:
    """Runs of the same samples under one model, each folder locked (one process per folder); with more
    than one, the prefill of each batch is shared. With `wait=False`, FolderBusy (nothing run, the locks
    taken so far released) where another process holds one of the folders."""
    say = one_line(console)
    configs = [run.config for run in runs]
    run_dirs = [RunDir(c.out, c.run_id()) for c in configs]
    with contextlib.ExitStack() as locks:
        for run_dir in sorted(run_dirs, key=lambda d: str(d.path)):  # one order for every process: no deadlock
            locks.enter_context(run_dir.locked(lambda path=run_dir.path: say(
                f"waiting for another evalkit process working on {path}"), wait=wait))
        pending = [(r, d) for r, d in zip(runs, run_dirs) if not d.complete]  # finished while we waited?
        resumed = dict(zip([r.config.run_id() for r, _ in pending], _run_locked(pending, mode, mirror, console))) \
            if pending else {}
        return [RunResult(c.run_id(), str(d.path), d.metrics(), None, resumed.get(c.run_id(), -1))
                for c, d in zip(configs, run_dirs)]


def _batches(runs: list[_RunInProgress], samples: list, inputs: list, batch_size: int):
    """(the runs that still need them, up to `batch_size` samples with their inputs), in the samples' order: a
    sample's prefill is shared by every run that still needs it, so runs that resumed at different points (a cell
    added to a grid half done, say) share the samples they both lack."""
    done = [ongoing.done for ongoing in runs]
    needing: tuple[int, ...] = ()
    batch: list = []
    for sample, sample_inputs in zip(samples, inputs):
        these = tuple(i for i in range(len(runs)) if sample.id not in done[i])
        if batch and (these != needing or len(batch) == batch_size):
            yield [runs[i] for i in needing], batch
            batch = []
        if these:
            needing = these
            batch.append((sample, sample_inputs))
    if batch:
        yield [runs[i] for i in needing], batch


def _run_locked(pending: list[tuple[ResolvedRun, RunDir]], mode: str, mirror: Mirror | None,
                console: Console) -> list[int]:
    """Runs every pending run to completion; returns how many samples each had recorded before."""
    say = one_line(console)
    for _, run_dir in pending:
        dropped = run_dir.repair()
        if dropped:
            say(f"note: {run_dir.predictions_path} held {dropped} repeated sample lines: kept the first of each")
    first, task = pending[0][0].config, pending[0][0].task
    torch.manual_seed(first.seed)
    with console.status(f"loading {first.model}"):
        model, tokenizer = load_model(first.model, first.dtype, first.device)
    with console.status(f"building {first.samples} samples of {first.length} tokens"):
        evaluation = evaluation_for(task, first, model, tokenizer)
    runs = []
    for resolved, run_dir in pending:
        settings = resolved.generation_settings()
        runs.append(_RunInProgress(resolved.config, run_dir, settings,
                                   _provenance(resolved.config, settings.policy, model), run_dir.predictions()))

    resumed_from = [len(ongoing.done) for ongoing in runs]
    total = len(evaluation.samples) * len(runs)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=console, transient=True,
                        disable=not console.is_terminal)  # transient: off a terminal it would leave only a blank line
    label = f"{first.policy} @ {first.budget}" if len(runs) == 1 else f"{len(runs)} runs, one prefill per sample"
    with progress:
        bar = progress.add_task(label, total=total, completed=sum(len(r.done) for r in runs))
        for group, batch in _batches(runs, evaluation.samples, evaluation.inputs, first.batch_size):
            settings = [ongoing.settings for ongoing in group]
            shared = evaluation.share(batch, settings) if len(group) > 1 else None
            for ongoing, records in zip(group, evaluation.evaluate(batch, settings, shared)):
                for record in records:
                    if not ongoing.run_dir.config_path.exists():
                        # Created with the first finished sample: input refused by the first batch
                        # (an exhausted page pool, say) leaves no run folder behind.
                        ongoing.run_dir.start(ongoing.provenance)
                    elif not ongoing.noted:
                        _note_the_machine(ongoing.run_dir, ongoing.provenance, len(ongoing.records))
                    ongoing.noted = True
                    ongoing.run_dir.append(record)
                    ongoing.records.append(record)
                progress.advance(bar, len(batch))

    order = {sample.id: i for i, sample in enumerate(evaluation.samples)}
    for ongoing in runs:
        ongoing.records.sort(key=lambda r: order.get(r["id"], len(order)))
        _finish(ongoing, evaluation.summarize(ongoing.records), task, mode, mirror, console)
    return resumed_from


def _finish(ongoing: _RunInProgress, metrics: dict, task, mode: str, mirror: Mirror | None,
            console: Console) -> None:
    """A run's artifacts, then its metrics.json (which makes it complete), then its W&B mirror."""
    if isinstance(task, WritesArtifacts):
        # Before metrics.json: a run whose artifact was interrupted is not complete, and a rerun redraws it.
        task.write_artifacts(ongoing.records, ongoing.run_dir.path, ongoing.provenance["config"])
    ongoing.run_dir.finish(metrics)
    if mode != "off" and mirror is not None:
        trouble: list[str] = []
        with console.status("logging to W&B"):  # lines printed under a status can be lost: said after it
            mirror.log_run(mode, ongoing.run_dir.path, ongoing.config.run_id(), ongoing.provenance, metrics,
                           ongoing.records, trouble.append)
        for line in trouble:
            one_line(console)(f"warning: {line}")


def one_line(console: Console) -> Callable[[str], None]:
    """Prints a message as one line, never wrapped, never read as markup (paths may hold brackets)."""
    return lambda text: console.print(text, highlight=False, soft_wrap=True, markup=False)


@runtime_checkable
class WritesArtifacts(Protocol):
    """A task that leaves files beside a finished run's results (the niah grid's heatmap.png)."""

    def write_artifacts(self, records: list[dict], folder: Path, config: dict) -> list[Path]: ...


def machine(model) -> dict:
    """What decides the last bits of the model's arithmetic besides the code: the same run on another CPU
    (AVX-512 rather than AVX2 kernels picked by MKL and torch) or another thread count can differ in the last
    bits of a key, enough to flip a tie between two tokens' scores."""
    device = next(model.parameters()).device
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"), "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}


def _provenance(config: RunConfig, policy, model) -> dict:
    return {"config": config.to_dict(), "run_id": config.run_id(), "policy": repr(policy),
            "model_class": type(model).__name__, "versions": package_versions(_PACKAGES),
            "python": platform.python_version(), "machine": machine(model),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _note_the_machine(run_dir: RunDir, provenance: dict, resumed_at: int) -> None:
    """A run resumed on another machine says so in its config.json: from which sample on (`later_machines`),
    so a sample's last bits can be traced to the kernels that computed it."""
    stored = read_json(run_dir.config_path)
    latest = (stored.get("later_machines") or [stored])[-1].get("machine")
    if latest != provenance["machine"]:
        stored.setdefault("later_machines", []).append(
            {"from_sample": resumed_at, "machine": provenance["machine"], "created": provenance["created"]})
        run_dir.start(stored)


def find_baseline(config: RunConfig, stored_runs: list[tuple[dict, dict]] | None = None) -> dict | None:
    """The metrics of the stored full-cache run on this run's samples (`config.baseline_for`); `stored_runs`:
    `complete_runs(config.out)` when the caller has read it already."""
    stored = complete_runs(config.out) if stored_runs is None else stored_runs
    return baseline_for(config.to_dict(), [(provenance.get("config", {}), metrics) for provenance, metrics in stored])
