"""The one validated object a run is made from; everything in it is checked before any work starts."""

from __future__ import annotations

import decimal
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from evalkit.assets import DEFAULT_MODEL
from evalkit.cache import LAYOUTS
from evalkit.errors import EvalkitError
from evalkit.kernels import KERNEL_MODES
from evalkit.models import check_device, window
from evalkit.policies import GRANULARITIES, POLICIES, make_policy
from evalkit.tasks import TASKS
from evalkit.tasks.custom import DataTask, is_data_task, make_task, run_label

WANDB_MODES = ("auto", "off", "offline", "online")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# More positions than any model has: token counts at or above it are refused before any arithmetic on them
# overflows, a buffer is sized from them, or one lands in a run id (a folder name).
TOKEN_LIMIT = 2**31
SEED_LIMIT = 2**32  # torch takes seeds below 2**64, and the random policy seeds each layer with seed * 100003 + layer


def parse_budget(text: str | float | int) -> float | int:
    """A fraction in (0, 1] of the prompt ('0.2', '1', '1.0') or a token count, an integer > 1 ('512')."""
    raw = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", raw):
        value = int(raw)
        if value <= 0:
            raise EvalkitError(f"budget must be > 0, got {raw}")
        if value >= TOKEN_LIMIT:
            raise EvalkitError(f"budget {raw} tokens is more than any model's window (the limit is 2**31)")
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
    return _key_values(items, "task-arg")


def parse_policy_args(items: list[str]) -> dict[str, str]:
    """`["window=64", "kernel=5"]` -> {"window": "64", "kernel": "5"}; the policy parses the values."""
    return _key_values(items, "policy-arg")


def _key_values(items: list[str], flag: str) -> dict[str, str]:
    args = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EvalkitError(f"{flag} must be KEY=VALUE, got {item!r}")
        args[key.strip()] = value.strip()
    return args


def smallest_fraction(length: int) -> float:
    """The smallest budget fraction (3 significant digits, rounded up) that keeps one token of `length`."""
    return float(decimal.Context(prec=3, rounding=decimal.ROUND_CEILING).divide(1, length))


@runtime_checkable
class SizedBySettings(Protocol):
    """A task whose settings (`--task-arg`), not only `--length`, set how long its samples are (the niah grid)."""

    def longest(self, length: int) -> int: ...


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
    policy_args: dict[str, str] = field(default_factory=dict)  # hyper-parameters, `--policy-arg key=value`
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
        """Every setting checked before any work: the model's config is read (its window), never its weights."""
        self.policy = POLICIES.canonical(self.policy)
        if not is_data_task(self.task):
            if self.task not in TASKS.names() and Path(self.task).is_file():
                raise EvalkitError(f"unknown task {self.task!r}; for your data file use --task jsonl:{self.task}")
            self.task = TASKS.canonical(self.task)
        self.budget = parse_budget(self.budget)
        choice("granularity", self.granularity, GRANULARITIES, optional=True)
        choice("layout", self.layout, LAYOUTS)
        choice("prefill", self.prefill, ("full", "chunked"))
        choice("wandb", self.wandb, WANDB_MODES)
        choice("dtype", self.dtype, DTYPES)
        choice("kernels", self.kernels, KERNEL_MODES)
        for name in ("block_size", "chunk_size", "samples", "length", "batch_size"):
            if getattr(self, name) < 1:
                raise EvalkitError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pool_pages is not None and self.pool_pages < 1:
            raise EvalkitError(f"pool-pages must be >= 1, got {self.pool_pages}")
        for name in ("length", "block_size", "chunk_size", "pool_pages"):
            if (getattr(self, name) or 0) >= TOKEN_LIMIT:
                raise EvalkitError(f"{name.replace('_', '-')} {getattr(self, name)} is more than any model's "
                                   "window (the limit is 2**31)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise EvalkitError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise EvalkitError(f"seed must be in [0, 2**32), got {self.seed}")
        check_device(self.device)
        self._check_budget()
        if is_data_task(self.task):
            self._resolve_data()  # it reads the data, which the checks above need not wait for
        else:
            self._refuse_data_options()
            self._check_window()
        return self

    def _check_budget(self) -> None:
        if self.budget <= 1 and self.budget * self.length < 1 - 1e-9:
            raise EvalkitError(f"budget {self.budget} keeps less than one token of --length {self.length}: the "
                               f"smallest useful fraction is {smallest_fraction(self.length):g}, or give a token "
                               f"count such as {max(2, self.block_size)}")
        policy = make_policy(self.policy, self.granularity, self.policy_args)
        policy.check_budget(self.budget, self.block_size, self.length)

    def _check_window(self) -> None:
        """Samples longer than the model's window are refused before any is built (a haystack of a
        million tokens takes minutes and gigabytes to build)."""
        task = make_task(self)
        longest = task.longest(self.length) if isinstance(task, SizedBySettings) else self.length
        lower = "the task's lengths" if "lengths" in self.task_args else "--length"
        limit = window(self.model)
        if limit and longest > limit:
            raise EvalkitError(f"a sample of {longest} positions (prompt + answer) does not fit, "
                               f"{self.model} has {limit}: lower {lower}")

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

    def full_cache(self) -> "RunConfig":
        """This run's full-cache baseline: policy `full` at budget 1, on the same samples and settings."""
        return replace(self, policy="full", budget=1.0, granularity=None, policy_args={})

    def identity(self) -> dict:
        left_out = self._NOT_IN_ID + (() if is_data_task(self.task) else self._DATA_FIELDS)
        if not self.policy_args:  # runs without hyper-parameters keep the ids they had before the option existed
            left_out += ("policy_args",)
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}

    def run_id(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]
        task = run_label(self.task) if is_data_task(self.task) else self.task.split(":")[-1]
        return f"{task}-{self.policy}-{self.budget}-{digest}"

    def to_dict(self) -> dict:
        return asdict(self)


def choice(name: str, value, allowed, optional: bool = False) -> None:
    """One line naming the allowed values when `value` is not one of them."""
    if value is None and optional:
        return
    if value not in allowed:
        raise EvalkitError(f"unknown {name} {value!r}; choose from {', '.join(allowed)}")
