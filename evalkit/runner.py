"""One evaluation: a task's samples through the generation loop under one policy and budget.

Everything that can be refused is refused before the run folder exists; a run
folder that exists is resumed, sample by sample.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.generate import GenerationSettings, Request, generate
from evalkit.models import load_model, max_positions
from evalkit.policies import make_policy
from evalkit.prompt import encode, prompt_length
from evalkit.results import RunDir, complete_runs, package_versions
from evalkit.tasks.custom import make_task
from evalkit.tracking import log_run, resolve_wandb_mode

_BASELINE_KEYS = ("task", "length", "samples", "model", "seed", "temperature", "dtype")
_PACKAGES = ("evalkit", "torch", "transformers", "triton", "datasets", "wandb")


@dataclass
class RunResult:
    run_id: str
    path: str
    metrics: dict
    baseline: dict | None  # metrics of the matching full-cache run, if one is on disk
    resumed_from: int  # samples found already done


def run(config: RunConfig, console: Console | None = None) -> RunResult:
    console = console or Console(stderr=True)
    config.validate()
    run_dir = RunDir(config.out, config.run_id())
    if run_dir.complete:
        return RunResult(config.run_id(), str(run_dir.path), run_dir.metrics(), _baseline(config), -1)

    task = make_task(config)
    policy = make_policy(config.policy, config.granularity)
    torch.manual_seed(config.seed)
    with console.status(f"loading {config.model}"):
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    with console.status(f"building {config.samples} samples of {config.length} tokens"):
        samples = task.samples(prompt_length(tokenizer), config.length, config.samples, config.seed)
        encoded = [encode(tokenizer, sample) for sample in samples]
    limit = max_positions(model)
    for sample, (context_ids, question_ids) in zip(samples, encoded):
        needed = len(context_ids) + len(question_ids) + sample.max_new_tokens
        if limit and needed > limit:
            raise EvalkitError(f"sample {sample.id} needs {needed} positions (prompt + answer) but "
                               f"{config.model} has {limit}: lower --length")

    settings = GenerationSettings(
        policy=policy, budget=config.budget, layout=config.layout, block_size=config.block_size,
        prefill=config.prefill, chunk_size=config.chunk_size, query_aware=config.query_aware,
        decode_eviction=config.decode_eviction, temperature=config.temperature, seed=config.seed,
        pool_pages=config.pool_pages,
    )
    provenance = _provenance(config, policy, model)
    records = run_dir.predictions()
    done = {record["id"] for record in records}
    todo = [(s, e) for s, e in zip(samples, encoded) if s.id not in done]

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=console, transient=True)
    with progress:
        bar = progress.add_task(f"{config.policy} @ {config.budget}", total=len(samples), completed=len(done))
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start:start + config.batch_size]
            requests = [Request(c, q, s.max_new_tokens) for s, (c, q) in batch]
            for (sample, _), gen in zip(batch, generate(model, tokenizer, requests, settings)):
                record = {
                    "id": sample.id, "prompt_tokens": gen.prompt_tokens, "prediction": gen.text,
                    "references": sample.references, "score": task.score(gen.text, sample.references),
                    "kept_tokens": gen.kept_tokens, "bytes_held": gen.bytes_held,
                    "bytes_ideal": gen.bytes_ideal, "bytes_full": gen.bytes_full,
                    "new_tokens": len(gen.token_ids), "attended_fraction": gen.attended_fraction,
                    "meta": sample.meta,
                    # Batch-wide timings, divided evenly so sums over records stay right.
                    **{key: value / len(batch) for key, value in gen.timing.items() if key.endswith("seconds")},
                }
                if not run_dir.config_path.exists():
                    # Created with the first finished sample: input refused by the first batch
                    # (an exhausted page pool, say) leaves no run folder behind.
                    run_dir.start(provenance)
                run_dir.append(record)
                records.append(record)
            progress.advance(bar, len(batch))

    order = {sample.id: i for i, sample in enumerate(samples)}
    records.sort(key=lambda r: order.get(r["id"], len(order)))
    metrics = aggregate(records)
    mode = resolve_wandb_mode(config.wandb)
    if mode != "off":
        with console.status("logging to W&B"):
            log_run(mode, run_dir.path, config.run_id(), provenance, metrics, records)
    run_dir.finish(metrics)
    return RunResult(config.run_id(), str(run_dir.path), metrics, _baseline(config), len(done))


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
    for stored, metrics in complete_runs(config.out):
        other = stored.get("config", {})
        if other.get("policy") == "full" and all(other.get(k) == getattr(config, k) for k in _BASELINE_KEYS):
            return metrics
    return None
