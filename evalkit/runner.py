"""Evaluations: a task's samples through the generation loop under one policy and budget (`run`),
or under several at once sharing each sample's prefill (`run_many`: a sweep's runs, a run and
its full-cache baseline), each run in its own folder as if it had run alone.

Everything that can be refused is refused before the run folder exists; a run
folder that exists is resumed, sample by sample, by one process at a time (the
folder's lock: a second process on it waits). Results are on disk before W&B
is told anything, so W&B can never cost one (the W&B mirror is handed in by the
caller, `mirror=evalkit.integrations.wandb`: the runner imports no tool). Most tasks generate answers
that the task scores; `ppl` streams passages through the cache and scores their
log-likelihood (`score_rolling`). A task with `write_artifacts` (the niah
grid's heatmap) writes its files into the run folder when the run finishes.
"""

from __future__ import annotations

import contextlib
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from evalkit.config import RunConfig, baseline_for, fields_where
from evalkit.errors import EvalkitError
from evalkit.loop import (GenerationSettings, Request, SharedPrefill, generate, generate_branches, prefill_statistics,
                          score_rolling, share_prefill)
from evalkit.models import load_model, max_positions
from evalkit.prompt import encode, prompt_length
from evalkit.results import Record, RunDir, check_writable_folder, complete_runs, package_versions
from evalkit.tasks import Sample, Task
from evalkit.tasks.custom import is_data_task, make_task
from evalkit.tasks.ppl import Perplexity, perplexity_metrics
from evalkit.uncertainty import score_interval

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


def run(config: RunConfig, console: Console | None = None, wandb_mode: str | None = None,
        mirror: Mirror | None = None) -> RunResult:
    """`wandb_mode`: the W&B mode already decided (a sweep decides once for its runs); None: decided
    here from `config.wandb`. `mirror`: the W&B mirror (`evalkit.integrations.wandb`, as `evalkit run`,
    `sweep` and `lm-eval` pass it); without one nothing is mirrored, and a W&B mode other than off or
    auto is refused."""
    return run_many([config], console, wandb_mode, mirror)[0]


def run_many(configs: list[RunConfig], console: Console | None = None, wandb_mode: str | None = None,
             mirror: Mirror | None = None, wait: bool = True) -> list[RunResult]:
    """Several runs; those that differ only in what happens after a full prefill (policy, budget,
    granularity, layout, ...) prefill each sample once and fork it (`shared_prefill.SharedPrefill`), the
    rest run one after another. Each run's folder ends exactly as `run` alone would leave it. A folder
    another process holds is waited for, or with `wait=False` raises FolderBusy before its group runs
    (the groups before it are done)."""
    console = console or Console(stderr=True)
    for config in configs:
        config.validate()
    say = one_line(console)
    results: dict[str, RunResult] = {}
    todo: dict[str, RunConfig] = {}  # by run id: a run asked for twice runs once
    for config in configs:
        run_dir = RunDir(config.out, config.run_id())
        if run_dir.complete:
            results[config.run_id()] = RunResult(config.run_id(), str(run_dir.path), run_dir.metrics(), None, -1)
        else:
            check_writable_folder(config.out, "--out")
            todo.setdefault(config.run_id(), config)
    if todo:
        mode = _wandb_mode(next(iter(todo.values())), wandb_mode, mirror, say)
        groups: dict[tuple, list[RunConfig]] = {}
        for run_id, config in todo.items():
            groups.setdefault(prefill_key(config) or (run_id,), []).append(config)
        for group in groups.values():
            results.update(zip([c.run_id() for c in group], _run_group(group, mode, mirror, console, wait)))
    # Baselines looked up last (a run's full-cache baseline may be one of the runs just made), reading
    # each results store once for all the runs: a sweep's group is dozens of runs.
    stores = {config.out: complete_runs(config.out) for config in configs}
    return [replace(results[config.run_id()], baseline=find_baseline(config, stores[config.out]))
            for config in configs]


def prefill_key(config: RunConfig) -> tuple | None:
    """What a run's prefill depends on, or None when it cannot be shared (chunked prefill streams
    through the policy's cache; perplexity is scored in chunks)."""
    if config.prefill != "full" or config.task == Perplexity.name:
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

    @property
    def done(self) -> set:
        return {record["id"] for record in self.records}


def _run_group(configs: list[RunConfig], mode: str, mirror: Mirror | None, console: Console,
               wait: bool) -> list[RunResult]:
    """Runs of the same samples under one model, each folder locked (one process per folder); with more
    than one, the prefill of each batch is shared. With `wait=False`, FolderBusy (nothing run, the locks
    taken so far released) where another process holds one of the folders."""
    say = one_line(console)
    run_dirs = [RunDir(c.out, c.run_id()) for c in configs]
    with contextlib.ExitStack() as locks:
        for run_dir in sorted(run_dirs, key=lambda d: str(d.path)):  # one order for every process: no deadlock
            locks.enter_context(run_dir.locked(lambda path=run_dir.path: say(
                f"waiting for another evalkit process working on {path}"), wait=wait))
        pending = [(c, d) for c, d in zip(configs, run_dirs) if not d.complete]  # finished while we waited?
        resumed = dict(zip([c.run_id() for c, _ in pending], _run_locked(pending, mode, mirror, console))) \
            if pending else {}
        return [RunResult(c.run_id(), str(d.path), d.metrics(), None, resumed.get(c.run_id(), -1))
                for c, d in zip(configs, run_dirs)]


def _run_locked(pending: list[tuple[RunConfig, RunDir]], mode: str, mirror: Mirror | None,
                console: Console) -> list[int]:
    """Runs every pending run to completion; returns how many samples each had recorded before."""
    say = one_line(console)
    for _, run_dir in pending:
        dropped = run_dir.repair()
        if dropped:
            say(f"note: {run_dir.predictions_path} held {dropped} repeated sample lines: kept the first of each")
    first = pending[0][0]
    task = make_task(first)
    torch.manual_seed(first.seed)
    with console.status(f"loading {first.model}"):
        model, tokenizer = load_model(first.model, first.dtype, first.device)
    with console.status(f"building {first.samples} samples of {first.length} tokens"):
        if isinstance(task, Perplexity):
            evaluation = _perplexity_evaluation(task, first, model, tokenizer)
        else:
            evaluation = _generation_evaluation(task, first, model, tokenizer)
    runs = []
    for config, run_dir in pending:
        settings = config.generation_settings()
        runs.append(_RunInProgress(config, run_dir, settings, _provenance(config, settings.policy, model),
                                   run_dir.predictions()))

    resumed_from = [len(ongoing.done) for ongoing in runs]
    total = len(evaluation.samples) * len(runs)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=console, transient=True,
                        disable=not console.is_terminal)  # transient: off a terminal it would leave only a blank line
    label = f"{first.policy} @ {first.budget}" if len(runs) == 1 else f"{len(runs)} runs, one prefill per sample"
    with progress:
        bar = progress.add_task(label, total=total, completed=sum(len(r.done) for r in runs))
        # Runs that resumed at different points share only their common todo.
        by_todo: dict[tuple, list[_RunInProgress]] = {}
        for ongoing in runs:
            by_todo.setdefault(tuple(s.id for s in evaluation.samples if s.id not in ongoing.done), []).append(ongoing)
        for todo_ids, group in by_todo.items():
            todo = [(s, inputs) for s, inputs in zip(evaluation.samples, evaluation.inputs) if s.id in set(todo_ids)]
            batch_size = group[0].config.batch_size
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                settings = [ongoing.settings for ongoing in group]
                shared = evaluation.share(batch, settings) if len(group) > 1 else None
                for ongoing, records in zip(group, evaluation.evaluate(batch, settings, shared)):
                    for record in records:
                        if not ongoing.run_dir.config_path.exists():
                            # Created with the first finished sample: input refused by the first batch
                            # (an exhausted page pool, say) leaves no run folder behind.
                            ongoing.run_dir.start(ongoing.provenance)
                        ongoing.run_dir.append(record)
                        ongoing.records.append(record)
                    progress.advance(bar, len(batch))

    order = {sample.id: i for i, sample in enumerate(evaluation.samples)}
    for ongoing in runs:
        ongoing.records.sort(key=lambda r: order.get(r["id"], len(order)))
        metrics = evaluation.summarize(ongoing.records)
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
                say(f"warning: {line}")
    return resumed_from


def one_line(console: Console) -> Callable[[str], None]:
    """Prints a message as one line, never wrapped, never read as markup (paths may hold brackets)."""
    return lambda text: console.print(text, highlight=False, soft_wrap=True, markup=False)


@runtime_checkable
class WritesArtifacts(Protocol):
    """A task that leaves files beside a finished run's results (the niah grid's heatmap.png)."""

    def write_artifacts(self, records: list[dict], folder: Path, config: dict) -> list[Path]: ...


@dataclass
class _Evaluation:
    """What a group of runs evaluates and how: the samples, each one's model input, a batch's records under
    each run's settings (from a shared prefill, if given), a run's metrics; and how to share a batch's
    prefill."""

    samples: list[Sample]
    inputs: list
    evaluate: Callable[[list[tuple[Sample, Any]], list[GenerationSettings], SharedPrefill | None], list[list[dict]]]
    summarize: Callable[[list[dict]], dict]
    share: Callable[[list[tuple[Sample, Any]], list[GenerationSettings]], SharedPrefill | None] = \
        lambda batch, settings: None


def _generation_evaluation(task: Task, config: RunConfig, model, tokenizer) -> _Evaluation:
    """Prompts whose answers are generated and scored by the task."""
    samples = task.samples(prompt_length(tokenizer), config.length, config.samples, config.seed)
    encoded = [encode(tokenizer, sample) for sample in samples]
    limit = max_positions(model)
    lower = ("the task's lengths" if "lengths" in config.task_args else
             "the record (data samples are never cut; skip it with --offset/--limit)" if is_data_task(config.task)
             else "--length")
    for sample, (context_ids, question_ids) in zip(samples, encoded):
        needed = len(context_ids) + len(question_ids) + sample.max_new_tokens
        if limit and needed > limit:
            raise EvalkitError(f"sample {sample.id} needs {needed} positions (prompt + answer) but "
                               f"{config.model} has {limit}: lower {lower}")

    def requests(batch: list[tuple[Sample, tuple[list[int], list[int]]]]) -> list[Request]:
        return [Request(c, q, s.max_new_tokens) for s, (c, q) in batch]

    def share(batch, each: list[GenerationSettings]) -> SharedPrefill:
        statistics = set().union(*(prefill_statistics(s.policy) for s in each))
        return share_prefill(model, requests(batch), each[0].query_aware, statistics, tokenizer)

    def evaluate(batch, each: list[GenerationSettings], shared: SharedPrefill | None) -> list[list[dict]]:
        if shared is None:
            generations = [generate(model, tokenizer, requests(batch), settings) for settings in each]
        else:  # the runs decode together, branches of the shared prefill (joint_decode)
            generations = generate_branches(model, tokenizer, requests(batch), each, shared)
        return [records(batch, run_generations) for run_generations in generations]

    def records(batch, generations) -> list[dict]:
        return [Record(
            sample.id, gen.prompt_tokens, task.score(gen.text, sample.references), gen.kept_tokens, gen.bytes_held,
            gen.bytes_ideal, gen.bytes_full, len(gen.token_ids), gen.attended_fraction, sample.meta,
            # Batch-wide timings, divided evenly so sums over records stay right.
            {key: value / len(batch) for key, value in gen.timing.items() if key.endswith("seconds")},
            {"prediction": gen.text, "references": sample.references},
        ).as_dict() for (sample, _), gen in zip(batch, generations)]

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), "metric": task.metric, "higher_is_better": True,
                **score_interval(records).as_metrics()}

    return _Evaluation(samples, encoded, evaluate, summarize, share)


def _perplexity_evaluation(task: Perplexity, config: RunConfig, model, tokenizer) -> _Evaluation:
    """Passages of `--length` tokens streamed in chunks; the loss of every token after the first chunk."""
    chunk = config.chunk_size
    if config.length <= chunk:
        raise EvalkitError(f"ppl scores the tokens after the first chunk: --length {config.length} must be "
                           f"more than --chunk-size {chunk}")
    samples = task.samples(prompt_length(tokenizer), config.length, config.samples, config.seed)
    passages = []
    for sample in samples:
        ids = tokenizer(sample.context).input_ids[:config.length]
        if len(ids) < config.length:
            raise EvalkitError(f"passage {sample.id} has only {len(ids)} tokens, fewer than --length {config.length}")
        passages.append(ids)

    def evaluate(batch: list[tuple[Sample, list[int]]], each: list[GenerationSettings],
                 shared: None) -> list[list[dict]]:
        return [evaluate_one(batch, settings) for settings in each]

    def evaluate_one(batch: list[tuple[Sample, list[int]]], settings: GenerationSettings) -> list[dict]:
        start = time.perf_counter()
        scores = score_rolling(model, [ids for _, ids in batch], [len(ids) - chunk for _, ids in batch], settings)
        seconds = (time.perf_counter() - start) / len(batch)  # batch-wide, divided evenly
        records = []
        for (sample, _), scored in zip(batch, scores):
            summary = task.loss_summary(scored.logprobs, first_position=chunk)
            records.append(Record(
                sample.id, scored.prompt_tokens, summary["perplexity"], scored.kept_tokens, scored.bytes_held,
                scored.bytes_ideal, scored.bytes_full, 0, 1.0, sample.meta,
                {"prefill_seconds": seconds, "decode_seconds": 0.0}, summary,
            ).as_dict())
        return records

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), **perplexity_metrics(records), "scored_from": chunk,
                **score_interval(records).as_metrics()}

    return _Evaluation(samples, passages, evaluate, summarize)


def aggregate(records: list[dict]) -> dict:
    """Means over samples; a group task (samples carrying meta["task"]) scores the mean of its tasks' means."""
    n = len(records)

    def total(key):
        return sum(r[key] for r in records)

    by_task: dict[str, list[float]] = {}
    for r in records:
        if "task" in r.get("meta", {}):
            by_task.setdefault(r["meta"]["task"], []).append(r["score"])
    task_means = {task: sum(scores) / len(scores) for task, scores in sorted(by_task.items())}
    return {
        "samples": n,
        "score": sum(task_means.values()) / len(task_means) if task_means else total("score") / n,
        **({"by_task": task_means} if task_means else {}),
        "kept_tokens": total("kept_tokens") / n,
        "prompt_tokens": total("prompt_tokens") / n,
        "bytes_held": total("bytes_held") / n,
        "bytes_ideal": total("bytes_ideal") / n,
        "bytes_full": total("bytes_full") / n,
        "held_over_full": total("bytes_held") / total("bytes_full"),
        "held_over_ideal": total("bytes_held") / max(1, total("bytes_ideal")),
        "attended_fraction": total("attended_fraction") / n,
        "prefill_tokens_per_s": total("prompt_tokens") / max(1e-9, total("prefill_seconds")),
        "decode_tokens_per_s": total("new_tokens") / max(1e-9, total("decode_seconds")),
        "seconds": total("prefill_seconds") + total("decode_seconds"),
        **({"reconstruction_seconds": total("reconstruction_seconds") / n}
           if all("reconstruction_seconds" in r for r in records) else {}),
    }


def _provenance(config: RunConfig, policy, model) -> dict:
    return {"config": config.to_dict(), "run_id": config.run_id(), "policy": repr(policy),
            "model_class": type(model).__name__, "versions": package_versions(_PACKAGES), "python": platform.python_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def find_baseline(config: RunConfig, stored_runs: list[tuple[dict, dict]] | None = None) -> dict | None:
    """The metrics of the stored full-cache run on this run's samples (`config.baseline_for`); `stored_runs`:
    `complete_runs(config.out)` when the caller has read it already."""
    stored = complete_runs(config.out) if stored_runs is None else stored_runs
    return baseline_for(config.to_dict(), [(provenance.get("config", {}), metrics) for provenance, metrics in stored])
