"""One evaluation: a task's samples through the generation loop under one policy and budget.

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

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.generate import GenerationSettings, Request, generate, score_rolling
from evalkit.models import load_model, max_positions
from evalkit.policies import make_policy
from evalkit.prompt import encode, prompt_length
from evalkit.results import RunDir, check_writable_folder, complete_runs, package_versions
from evalkit.tasks import Sample, Task
from evalkit.tasks.custom import is_data_task, make_task
from evalkit.tasks.ppl import Perplexity, perplexity_metrics

_BASELINE_KEYS = ("task", "task_args", "length", "samples", "model", "seed", "temperature", "dtype",
                  "data_format", "metric", "offset", "data_sha256")
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
    """`wandb_mode`: the W&B mode already decided (a sweep decides once for its cells); None: decided
    here from `config.wandb`. `mirror`: the W&B mirror (`evalkit.integrations.wandb`, as `evalkit run`,
    `sweep` and `lm-eval` pass it); without one nothing is mirrored, and a W&B mode other than off or
    auto is refused."""
    console = console or Console(stderr=True)
    config.validate()
    run_dir = RunDir(config.out, config.run_id())
    if run_dir.complete:
        return RunResult(config.run_id(), str(run_dir.path), run_dir.metrics(), _baseline(config), -1)
    check_writable_folder(config.out, "--out")
    say = one_line(console)
    mode = _wandb_mode(config, wandb_mode, mirror, say)
    with run_dir.locked(lambda: say(f"waiting for another evalkit process working on {run_dir.path}")):
        if run_dir.complete:  # finished by the process we waited for
            return RunResult(config.run_id(), str(run_dir.path), run_dir.metrics(), _baseline(config), -1)
        return _run_locked(config, run_dir, mode, mirror, console)


def _wandb_mode(config: RunConfig, decided: str | None, mirror: Mirror | None, say: Callable[[str], None]) -> str:
    if mirror is None:
        requested = decided or config.wandb
        if requested not in ("off", "auto"):
            raise EvalkitError(f"wandb={requested!r} needs a mirror: runner.run(..., "
                               "mirror=evalkit.integrations.wandb)")
        return "off"
    return decided or mirror.decide_wandb_mode(config.wandb, lambda line: say(f"note: {line}"))


def _run_locked(config: RunConfig, run_dir: RunDir, mode: str, mirror: Mirror | None,
                console: Console) -> RunResult:
    dropped = run_dir.repair()
    if dropped:
        one_line(console)(f"note: {run_dir.predictions_path} held {dropped} repeated sample lines: kept the "
                          "first of each")
    task = make_task(config)
    policy = make_policy(config.policy, config.granularity, config.policy_args)
    torch.manual_seed(config.seed)
    with console.status(f"loading {config.model}"):
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    settings = GenerationSettings(
        policy=policy, budget=config.budget, layout=config.layout, block_size=config.block_size,
        prefill=config.prefill, chunk_size=config.chunk_size, query_aware=config.query_aware,
        decode_eviction=config.decode_eviction, temperature=config.temperature, seed=config.seed,
        pool_pages=config.pool_pages, kernels=config.kernels,
    )
    with console.status(f"building {config.samples} samples of {config.length} tokens"):
        if isinstance(task, Perplexity):
            plan = _perplexity_plan(task, config, model, tokenizer, settings)
        else:
            plan = _generation_plan(task, config, model, tokenizer, settings)

    provenance = _provenance(config, policy, model)
    records = run_dir.predictions()
    done = {record["id"] for record in records}
    todo = [(s, inputs) for s, inputs in zip(plan.samples, plan.inputs) if s.id not in done]

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=console, transient=True)
    with progress:
        bar = progress.add_task(f"{config.policy} @ {config.budget}", total=len(plan.samples), completed=len(done))
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start:start + config.batch_size]
            for record in plan.evaluate(batch):
                if not run_dir.config_path.exists():
                    # Created with the first finished sample: input refused by the first batch
                    # (an exhausted page pool, say) leaves no run folder behind.
                    run_dir.start(provenance)
                run_dir.append(record)
                records.append(record)
            progress.advance(bar, len(batch))

    order = {sample.id: i for i, sample in enumerate(plan.samples)}
    records.sort(key=lambda r: order.get(r["id"], len(order)))
    metrics = plan.summarize(records)
    if isinstance(task, WritesArtifacts):
        # Before metrics.json: a run whose artifact was interrupted is not complete, and a rerun redraws it.
        task.write_artifacts(records, run_dir.path, provenance["config"])
    run_dir.finish(metrics)
    if mode != "off" and mirror is not None:
        trouble: list[str] = []
        with console.status("logging to W&B"):  # lines printed under a status can be lost: said after it
            mirror.log_run(mode, run_dir.path, config.run_id(), provenance, metrics, records, trouble.append)
        for line in trouble:
            one_line(console)(f"warning: {line}")
    return RunResult(config.run_id(), str(run_dir.path), metrics, _baseline(config), len(done))


def one_line(console: Console) -> Callable[[str], None]:
    """Prints a message as one line, never wrapped, never read as markup (paths may hold brackets)."""
    return lambda text: console.print(text, highlight=False, soft_wrap=True, markup=False)


@runtime_checkable
class WritesArtifacts(Protocol):
    """A task that leaves files beside a finished run's results (the niah grid's heatmap.png)."""

    def write_artifacts(self, records: list[dict], folder: Path, config: dict) -> list[Path]: ...


@dataclass
class _Plan:
    """What a run evaluates and how: the samples, each one's model input, a batch's records, the run's metrics."""

    samples: list[Sample]
    inputs: list
    evaluate: Callable[[list[tuple[Sample, Any]]], list[dict]]
    summarize: Callable[[list[dict]], dict]


def _generation_plan(task: Task, config: RunConfig, model, tokenizer, settings: GenerationSettings) -> _Plan:
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

    def evaluate(batch: list[tuple[Sample, tuple[list[int], list[int]]]]) -> list[dict]:
        requests = [Request(c, q, s.max_new_tokens) for s, (c, q) in batch]
        return [{
            "id": sample.id, "prompt_tokens": gen.prompt_tokens, "prediction": gen.text,
            "references": sample.references, "score": task.score(gen.text, sample.references),
            "kept_tokens": gen.kept_tokens, "bytes_held": gen.bytes_held,
            "bytes_ideal": gen.bytes_ideal, "bytes_full": gen.bytes_full,
            "new_tokens": len(gen.token_ids), "attended_fraction": gen.attended_fraction,
            "meta": sample.meta,
            # Batch-wide timings, divided evenly so sums over records stay right.
            **{key: value / len(batch) for key, value in gen.timing.items() if key.endswith("seconds")},
        } for (sample, _), gen in zip(batch, generate(model, tokenizer, requests, settings))]

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), "metric": task.metric, "higher_is_better": True}

    return _Plan(samples, encoded, evaluate, summarize)


def _perplexity_plan(task: Perplexity, config: RunConfig, model, tokenizer, settings: GenerationSettings) -> _Plan:
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

    def evaluate(batch: list[tuple[Sample, list[int]]]) -> list[dict]:
        start = time.perf_counter()
        scores = score_rolling(model, [ids for _, ids in batch], [len(ids) - chunk for _, ids in batch], settings)
        seconds = (time.perf_counter() - start) / len(batch)  # batch-wide, divided evenly
        records = []
        for (sample, _), scored in zip(batch, scores):
            summary = task.loss_summary(scored.logprobs, first_position=chunk)
            records.append({
                "id": sample.id, "prompt_tokens": scored.prompt_tokens, "score": summary["perplexity"], **summary,
                "kept_tokens": scored.kept_tokens, "bytes_held": scored.bytes_held,
                "bytes_ideal": scored.bytes_ideal, "bytes_full": scored.bytes_full,
                "new_tokens": 0, "attended_fraction": 1.0, "meta": sample.meta,
                "prefill_seconds": seconds, "decode_seconds": 0.0,
            })
        return records

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), **perplexity_metrics(records), "scored_from": chunk}

    return _Plan(samples, passages, evaluate, summarize)


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
    }


def _provenance(config: RunConfig, policy, model) -> dict:
    return {"config": config.to_dict(), "run_id": config.run_id(), "policy": repr(policy),
            "model_class": type(model).__name__, "versions": package_versions(_PACKAGES), "python": platform.python_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _baseline(config: RunConfig) -> dict | None:
    # Perplexity scores the tokens after the first chunk: only runs with the same chunk compare.
    keys = _BASELINE_KEYS + (("chunk_size",) if config.task == Perplexity.name else ())
    for stored, metrics in complete_runs(config.out):
        other = stored.get("config", {})
        if other.get("policy") == "full" and all(other.get(k) == getattr(config, k) for k in keys):
            return metrics
    return None
