"""The one validated object a run is made from; everything in it is checked before any work starts."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from evalkit.assets import DEFAULT_MODEL
from evalkit.cache import LAYOUTS
from evalkit.errors import EvalkitError
from evalkit.kernels import KERNEL_MODES
from evalkit.policies import GRANULARITIES, POLICIES
from evalkit.tasks import TASKS
from evalkit.tasks.custom import DataTask, is_data_task, run_label

WANDB_MODES = ("auto", "off", "offline", "online")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_budget(text: str | float | int) -> float | int:
    """A fraction in (0, 1] of the prompt ('0.2', '1', '1.0') or a token count, an integer > 1 ('512')."""
    raw = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", raw):
        value = int(raw)
        if value <= 0:
            raise EvalkitError(f"budget must be > 0, got {raw}")
        return 1.0 if value == 1 else value
    try:
        value = float(raw)
    except ValueError:
        raise EvalkitError(f"budget must be a fraction in (0, 1] or a token count > 1, got {raw!r}") from None
    if not 0 < value <= 1:
        raise EvalkitError(
            f"budget {raw} is out of range: a fraction must be in (0, 1]; a token count must be an integer > 1"
        )
    return value


def parse_task_args(items: list[str]) -> dict[str, str]:
    """`["depths=0,50,100", "lengths=1k,2k"]` -> {"depths": "0,50,100", "lengths": "1k,2k"}."""
    args = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EvalkitError(f"task-arg must be KEY=VALUE, got {item!r}")
        args[key.strip()] = value.strip()
    return args


@dataclass
class RunConfig:
    policy: str = "h2o_head"
    budget: float | int = 0.2
    task: str = "ruler:niah_single_2"
    task_args: dict[str, str] = field(default_factory=dict)  # task-specific settings, `--task-arg key=value`
    length: int = 2048  # prompt + answer tokens per sample, fitted with the model's tokenizer
    samples: int = 10
    model: str = DEFAULT_MODEL
    layout: str = "paged"
    block_size: int = 16
    granularity: str | None = None  # None: the policy's own
    prefill: str = "full"
    chunk_size: int = 512
    query_aware: bool = True
    decode_eviction: bool = True
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 1
    pool_pages: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    out: str = "runs"
    wandb: str = "auto"
    kernels: str = "auto"  # attention: auto (Triton on CUDA), triton, torch
    # Data tasks (`jsonl:PATH`, `hf:NAME[:CONFIG]:SPLIT`) only; validate() resolves them. There
    # `samples` becomes the number of records in [offset, offset + limit): data is never cut short.
    data_format: str | None = None  # kvpress, ruler or longbench; None or "auto": detected
    metric: str | None = None  # a METRICS name; None: the format's own
    limit: int | None = None  # None: every record from offset on
    offset: int | None = None  # None: 0
    data_sha256: str | None = None  # SHA-256 of the selected records, so an edited file is a new run
    question_split: bool | None = None  # whether the data keeps the question apart from the context

    # Fields that cannot change a result: left out of the run id.
    _NOT_IN_ID = ("out", "wandb", "batch_size", "kernels")
    # Unset for registered tasks, and then left out of the id, so that their run ids stay what they were.
    _DATA_FIELDS = ("data_format", "metric", "limit", "offset", "data_sha256", "question_split")

    def validate(self) -> "RunConfig":
        self.policy = POLICIES.canonical(self.policy)
        if not is_data_task(self.task):
            if self.task not in TASKS.names() and Path(self.task).is_file():
                raise EvalkitError(f"unknown task {self.task!r}; for your data file use --task jsonl:{self.task}")
            self.task = TASKS.canonical(self.task)
        self.budget = parse_budget(self.budget)
        _choice("granularity", self.granularity, GRANULARITIES, optional=True)
        _choice("layout", self.layout, LAYOUTS)
        _choice("prefill", self.prefill, ("full", "chunked"))
        _choice("wandb", self.wandb, WANDB_MODES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("kernels", self.kernels, KERNEL_MODES)
        for name in ("block_size", "chunk_size", "samples", "length", "batch_size"):
            if getattr(self, name) < 1:
                raise EvalkitError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pool_pages is not None and self.pool_pages < 1:
            raise EvalkitError(f"pool-pages must be >= 1, got {self.pool_pages}")
        if self.temperature < 0:
            raise EvalkitError(f"temperature must be >= 0, got {self.temperature}")
        if is_data_task(self.task):
            self._resolve_data()  # last: it reads the data, which the checks above need not wait for
        else:
            self._refuse_data_options()
        return self

    def _resolve_data(self) -> None:
        task = DataTask(self.task, self.data_format, self.metric, self.limit, self.offset, self.task_args)
        self.task, self.data_format, self.metric = task.name, task.data_format, task.metric
        self.offset, self.samples = task.indices.start, len(task.indices)
        self.data_sha256, self.question_split = task.sha256, task.question_split

    def _refuse_data_options(self) -> None:
        if self.data_format == "auto":
            self.data_format = None
        for option, value in (("format", self.data_format), ("metric", self.metric), ("limit", self.limit),
                              ("offset", self.offset)):
            if value is not None:
                raise EvalkitError(f"--{option} is for data tasks (jsonl:PATH, hf:NAME[:CONFIG]:SPLIT), "
                                   f"not {self.task}")
        self.data_sha256 = self.question_split = None

    def identity(self) -> dict:
        left_out = self._NOT_IN_ID + (() if is_data_task(self.task) else self._DATA_FIELDS)
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}

    def run_id(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]
        task = run_label(self.task) if is_data_task(self.task) else self.task.split(":")[-1]
        return f"{task}-{self.policy}-{self.budget}-{digest}"

    def to_dict(self) -> dict:
        return asdict(self)


def _choice(name: str, value, allowed, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        raise EvalkitError(f"unknown {name} {value!r}; choose from {', '.join(allowed)}")
