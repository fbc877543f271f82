"""Tasks a run is made from: registered names, and the user's own data.

Data tasks are `jsonl:PATH` (a JSON Lines file) and `hf:NAME[:CONFIG]:SPLIT` (anything
`datasets.load_dataset` loads, or a folder written by `Dataset.save_to_disk`). Their records are
in one of three formats, named with `--format` or detected from the first record's columns:

- `kvpress`, the columns of kvpress and most KV-compression work: `context`, `question`,
  `answers` (kvpress's own datasets call it `answer`; a string or a list of strings),
  `max_new_tokens`, and optionally `answer_prefix`, `id` and `task`. The question stays apart
  from the context, so query-agnostic runs compress the context before the question is seen.
- `ruler`, RULER's prepared JSONL (scripts/data/prepare.py): `input`, `outputs`, and optionally
  `answer_prefix`, `index`, `length`. RULER's question is inside `input`, so the whole input is
  the context (`question_split` is false in the run's config) and a query-agnostic run compresses
  all of it. RULER's files do not say how many tokens to generate: 128 (RULER's NIAH setting,
  the largest of its tasks) unless a record has `max_new_tokens`.
- `longbench`, LongBench's published records (`input`, `context`, `answers`, `dataset`, ...),
  handled by `evalkit.tasks.longbench`: the dataset's prompt template, generation length and
  metric, and its context cut in the middle to `--length`, as LongBench does. One dataset a file.

Choices, for every format:
- The samples are the records in [offset, offset + limit), in the data's order (the seed does not
  reorder them); the run's `samples` is set to their number, so user data is never cut short. A JSONL
  file is read only up to its last selected record, so `--limit` stops the reading.
- kvpress and RULER records are never cut: `--length` is a ceiling, and a sample whose prompt
  plus `max_new_tokens` is over it is refused (the runner also refuses any over the model's window).
  A record whose prompt has more than `MAX_CHARS_PER_TOKEN` characters per token of `--length` cannot
  fit at any tokenisation: it is refused, naming it, before anything is tokenised (a tokenizer takes
  minutes over a 50 MB record).
- A sample's id is the record's `id` (for RULER also `index`), else its position in the data
  counting from 0, the numbering `--offset` uses. Ids must be unique: a run resumes by id.
- Records with a `task` are scored per task and reported as the mean of the task means; then
  every record needs one.
- `--metric` picks a METRICS function (`string_match_all` unless the format has its own);
  `--task-arg max_new_tokens=N` sets every kvpress/RULER record's generation length.
- `sha256` is the SHA-256 of the selected records as canonical JSON; it goes into the run id,
  so an edited record makes a new run rather than passing for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from evalkit.errors import EvalkitError
from evalkit.tasks.base import MAX_CHARS_PER_TOKEN, TASKS, PromptLength, Sample, Task
from evalkit.tasks.data_source import DataSource
from evalkit.tasks.longbench import DATASETS as LONGBENCH_DATASETS
from evalkit.tasks.longbench import LongBenchTask, check_records
from evalkit.tasks.metrics import METRICS, first_line

FORMATS = ("kvpress", "ruler", "longbench")
DEFAULT_METRIC = "string_match_all"
METRIC_ALIASES = {"f1": "qa_f1"}
RULER_MAX_NEW_TOKENS = 128  # RULER's tokens_to_generate for NIAH
_NEEDS_CLASSES = "classification"  # a metric that needs LongBench's all_classes beside the references
_EXPECTED = "kvpress (context, question, answers), ruler (input, outputs) or longbench (input, context, answers)"


def make_task(config) -> Task:
    if is_data_task(config.task):
        return DataTask(config.task, config.data_format, config.metric, config.limit, config.offset,
                        config.task_args)
    task = TASKS.create(config.task)
    return task.with_args(config.task_args) if config.task_args else task


def is_data_task(task: str) -> bool:
    return task.startswith(("jsonl:", "hf:"))


def run_label(task: str) -> str:
    """A data task's short name for run folders: the file's stem, or the dataset's name and config."""
    kind, _, rest = task.partition(":")
    if kind == "jsonl":
        label = Path(rest).stem
    else:
        parts = rest.split(":")
        label = "-".join([Path(parts[0]).name, *parts[1:-1]])
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label) or kind


class DataTask(Task):
    """The records of a data source in one format, a slice of them as samples (see the module docstring)."""

    source = "the user's data"

    def __init__(self, task: str, data_format: str | None = None, metric: str | None = None,
                 limit: int | None = None, offset: int | None = None, task_args: dict[str, str] | None = None):
        metric, offset = _check_options(data_format, metric, limit, offset)
        data = DataSource.parse(task)
        self.name = data.task
        where = data.name if data.kind == "jsonl" else data.task
        self._where = where
        records = data.read(None if limit is None else offset + limit)
        if not records:
            raise EvalkitError(f"{where} holds no records")
        self.data_format = data_format if data_format in FORMATS else _detect(records[0], where)
        self.question_split = self.data_format != "ruler"
        self._longbench: LongBenchTask | None = None
        if self.data_format == "longbench":
            if task_args:
                raise EvalkitError(f"LongBench data takes no --task-arg settings (each dataset sets its "
                                   f"generation length), got {', '.join(sorted(task_args))}")
            self._longbench = _longbench_task(records, where)
            own_metric = self._longbench.metric
        else:
            self._built = _build_samples(self.data_format, records, where, _max_new_tokens_arg(task_args or {}))
            own_metric = DEFAULT_METRIC
        if metric == _NEEDS_CLASSES and own_metric != _NEEDS_CLASSES:
            raise EvalkitError("metric classification needs LongBench's all_classes: only for LongBench's trec data")
        self.metric = metric or own_metric

        if offset >= len(records):
            raise EvalkitError(f"offset {offset} is past the end of {where} ({len(records)} records)")
        self.indices = range(offset, len(records) if limit is None else min(len(records), offset + limit))
        selected = [records[index] for index in self.indices]
        self.sha256 = hashlib.sha256(json.dumps(selected, sort_keys=True, ensure_ascii=False, default=str)
                                     .encode()).hexdigest()
        self.description = (f"{self.data_format} records {self.indices.start} to {self.indices.stop - 1} "
                            f"of {where}, scored with {self.metric}")

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        """The first `n` selected records (the runner asks for all of them), in the data's order."""
        if n > len(self.indices):
            raise EvalkitError(f"{self.name}: {len(self.indices)} records selected; {n} asked for")
        indices = self.indices[:n]
        if self._longbench is not None:
            return [self._longbench.fit(prompt_length, length, index) for index in indices]
        self.check_sizes(length)
        samples = [self._built[index] for index in indices]
        needed = {sample.id: prompt_length(sample) + sample.max_new_tokens for sample in samples}
        over = {sample_id: tokens for sample_id, tokens in needed.items() if tokens > length}
        if over:
            longest = max(over, key=over.get)
            raise EvalkitError(f"{len(over)} of {len(samples)} samples need more than --length {length} tokens "
                               f"(prompt + max_new_tokens; sample {longest} needs {over[longest]}): "
                               f"raise --length, data samples are never cut")
        return samples

    def check_sizes(self, tokens: int, limit: str | None = None) -> None:
        """Refuses, before anything is tokenised, a selected kvpress or RULER record whose prompt cannot fit
        `tokens` tokens at any tokenisation (more than MAX_CHARS_PER_TOKEN characters a token); `limit` names
        what sets them (default `--length N`; the model's window before any model loads)."""
        if self._longbench is not None:
            return  # LongBench's contexts are cut to fit
        for sample in (self._built[index] for index in self.indices):
            chars = len(sample.context) + len(sample.question) + len(sample.answer_prefix)
            if chars > tokens * MAX_CHARS_PER_TOKEN:
                raise EvalkitError(f"{self._where}: record {sample.meta['record'] + 1} (id {sample.id!r}) has "
                                   f"{chars:,} characters of prompt, more than {limit or f'--length {tokens}'} "
                                   f"tokens hold at {MAX_CHARS_PER_TOKEN} characters a token: data samples are "
                                   f"never cut; skip it with --offset/--limit")

    def score(self, prediction: str, references: list[str]) -> float:
        if self._longbench is not None:
            if self.metric == self._longbench.metric:
                return self._longbench.score(prediction, references)
            if self._longbench.spec.first_line:  # LongBench's cleaning belongs to the dataset, not the metric
                prediction = first_line(prediction)
        return METRICS[self.metric](prediction, references)


def _check_options(data_format: str | None, metric: str | None, limit: int | None,
                   offset: int | None) -> tuple[str | None, int]:
    """The options refused before any data is read; returns the metric's own name and the offset."""
    if data_format not in (None, "auto", *FORMATS):
        raise EvalkitError(f"unknown format {data_format!r}; choose from auto, {', '.join(FORMATS)}")
    metric = METRIC_ALIASES.get(metric, metric)
    if metric is not None and metric not in METRICS:
        raise EvalkitError(f"unknown metric {metric!r}; choose from {', '.join(sorted([*METRICS, *METRIC_ALIASES]))}")
    if limit is not None and limit < 1:
        raise EvalkitError(f"limit must be >= 1, got {limit}")
    if offset is not None and offset < 0:
        raise EvalkitError(f"offset must be >= 0, got {offset}")
    return metric, offset or 0


def _detect(record: dict, where: str) -> str:
    columns = set(record)
    if {"context", "question"} <= columns:
        return "kvpress"
    if {"input", "outputs"} <= columns:
        return "ruler"
    if {"input", "context", "answers"} <= columns:
        return "longbench"
    raise EvalkitError(f"{where}: cannot tell the format from the columns of record 1 "
                       f"({', '.join(sorted(columns)) or 'none'}); expected {_EXPECTED}, or name one with --format")


def _max_new_tokens_arg(task_args: dict[str, str]) -> int | None:
    unknown = sorted(set(task_args) - {"max_new_tokens"})
    if unknown:
        raise EvalkitError(f"data tasks take --task-arg max_new_tokens=N only, got {', '.join(unknown)}")
    if "max_new_tokens" not in task_args:
        return None
    value = task_args["max_new_tokens"]
    if not value.isdigit() or int(value) < 1:
        raise EvalkitError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    return int(value)


def _longbench_task(records: list[dict], where: str) -> LongBenchTask:
    names = set()
    for number, record in enumerate(records, 1):
        if not record.get("dataset"):
            raise EvalkitError(f"{where}: record {number} lacks the column 'dataset' (the LongBench dataset, "
                               f"which sets the prompt template, generation length and metric)")
        names.add(str(record["dataset"]))
    if len(names) > 1:
        raise EvalkitError(f"{where}: records of several LongBench datasets ({', '.join(sorted(names))}); "
                           f"give one dataset a file")
    (name,) = names
    if name not in LONGBENCH_DATASETS and name.removesuffix("_e") in LONGBENCH_DATASETS:
        name = name.removesuffix("_e")  # LongBench-E: the same dataset at spread-out lengths
    if name not in LONGBENCH_DATASETS:
        raise EvalkitError(f"{where}: unknown LongBench dataset {name!r}; built: {', '.join(LONGBENCH_DATASETS)}")
    return LongBenchTask(name, records=check_records(records, name, where))


def _build_samples(data_format: str, records: list[dict], where: str, max_new_tokens: int | None) -> list[Sample]:
    samples = [_sample(data_format, index, record, f"{where}: record {index + 1}", max_new_tokens)
               for index, record in enumerate(records)]
    seen: dict[str, int] = {}
    for index, sample in enumerate(samples):
        if sample.id in seen:
            raise EvalkitError(f"{where}: records {seen[sample.id] + 1} and {index + 1} have the same id "
                               f"{sample.id!r}; ids must be unique (a run resumes by id)")
        seen[sample.id] = index
    with_task = sum("task" in sample.meta for sample in samples)
    if 0 < with_task < len(samples):
        index = next(i for i, sample in enumerate(samples) if "task" not in sample.meta)
        raise EvalkitError(f"{where}: record {index + 1} has no 'task' while others have one; "
                           f"give every record a task or none")
    return samples


def _sample(data_format: str, index: int, record: dict, place: str, max_new_tokens: int | None) -> Sample:
    if data_format == "kvpress":
        context, question = _text(record, "context", place), _text(record, "question", place)
        column = "answers" if record.get("answers") is not None else "answer"
        if record.get(column) is None:
            raise EvalkitError(f"{place} lacks the column 'answers' (or kvpress's 'answer')")
        references = _references(record, column, place)
        default_tokens, identity = None, record.get("id")
    else:
        context, question = _text(record, "input", place), ""
        references = _references(record, "outputs", place)
        default_tokens = RULER_MAX_NEW_TOKENS
        identity = record.get("index") if record.get("id") is None else record["id"]
    meta = {"record": index}
    if record.get("task") is not None:
        meta["task"] = str(record["task"])
    if data_format == "ruler" and record.get("length") is not None:
        meta["length"] = record["length"]  # RULER's own count, with its tokenizer
    return Sample(
        id=str(index if identity is None else identity),
        context=context,
        question=question,
        answer_prefix=_text(record, "answer_prefix", place, default=""),
        references=references,
        max_new_tokens=max_new_tokens or _positive_int(record, "max_new_tokens", place, default_tokens),
        meta=meta,
    )


# A column a record holds as null counts as missing: datasets gives every row every column.
def _text(record: dict, column: str, place: str, default: str | None = None) -> str:
    value = default if record.get(column) is None else record[column]
    if value is None:
        raise EvalkitError(f"{place} lacks the column {column!r}")
    if not isinstance(value, str):
        raise EvalkitError(f"{place}: {column!r} must be a string, got {type(value).__name__}")
    return value


def _references(record: dict, column: str, place: str) -> list[str]:
    value = record.get(column)
    if value is None:
        raise EvalkitError(f"{place} lacks the column {column!r}")
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or not items
            or not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items)):
        raise EvalkitError(f"{place}: {column!r} must be a string or a non-empty list of strings")
    return [str(item) for item in items]


def _positive_int(record: dict, column: str, place: str, default: int | None) -> int:
    value = default if record.get(column) is None else record[column]
    if value is None:
        raise EvalkitError(f"{place} lacks the column {column!r} (or give --task-arg {column}=N)")
    # Columns that went through pandas can hold whole numbers as floats.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EvalkitError(f"{place}: {column!r} must be an integer >= 1, got {value!r}")
    return value
