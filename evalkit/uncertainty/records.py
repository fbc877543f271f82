"""A run's records (predictions.jsonl lines) as the numbers the statistics work on: put in id order, each
sample's score and its weight in the run's score, the samples split by task (a group task's), and the run's
score itself, as `evaluations.aggregate` gives it (the mean; the mean of its tasks' means; perplexity over
every scored token)."""

from __future__ import annotations

import json
import re

import numpy as np


def in_id_order(records: list[dict]) -> list[dict]:
    """The records sorted by id (as JSON, so any id sorts; numbers in it by value: s2 before s10): what is
    computed from them, resamples included, is the same however a file's lines are ordered."""
    def key(record):
        parts = re.split(r"(\d+)", json.dumps(record["id"], sort_keys=True))
        return [int(part) if i % 2 else part for i, part in enumerate(parts)]

    return sorted(records, key=key)


def is_binary(records: list[dict]) -> bool:
    return all(r["score"] in (0, 1) for r in records)


def _tasks(records: list[dict]) -> list[str]:
    """The tasks of a group task's samples (meta["task"]), in order; empty for a single task."""
    return sorted({r["meta"]["task"] for r in records if "task" in r.get("meta", {})})


def _is_perplexity(records: list[dict]) -> bool:
    return all("nll" in r and "scored_tokens" in r for r in records)


def _per_sample(records: list[dict]) -> np.ndarray:
    return np.array([float(r["score"]) for r in records])


def score_of(records: list[dict]) -> float:
    """The score `evaluations.aggregate` (perplexity: `perplexity_metrics`) gives these records."""
    if _is_perplexity(records):
        return float(np.exp(sum(r["nll"] for r in records) / sum(r["scored_tokens"] for r in records)))
    by_task = _by_task(_per_sample(records), records)
    return float(np.mean([scores.mean() for scores in by_task]))


def _by_task(values: np.ndarray, records: list[dict]) -> list[np.ndarray]:
    """`values` [n] split by the task of each sample (one part for a single task)."""
    tasks = _tasks(records)
    if not tasks:
        return [values]
    of = np.array([r["meta"]["task"] for r in records])
    return [values[of == task] for task in tasks]


def _weights(records: list[dict]) -> np.ndarray:
    """Each sample's weight [n] in the score: the mean of the tasks' means is linear in the samples' scores."""
    parts = _by_task(np.arange(len(records)), records)
    weight = np.zeros(len(records))
    for part in parts:
        weight[part] = 1 / (len(parts) * len(part))
    return weight
