"""The options a run is made from (`RunConfig`), all checked before any work starts, and the run they resolve to
(`ResolvedRun`: the config with its policy and task, made once)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from evalkit.assets import DEFAULT_MODEL
from evalkit.cache import LAYOUTS
from evalkit.errors import EvalkitError
from evalkit.kernels import KERNEL_MODES
from evalkit.models import check_device, max_positions_of, model_config
from evalkit.loop import GenerationSettings
from evalkit.loop.state import SLIDING_LAYERS
from evalkit.policies import POLICIES, Budget, Policy, make_policy, parse_budget
from evalkit.policies.names import policy_label, refuse_contradiction
from evalkit.policies.budget import TOKEN_LIMIT
from evalkit.tasks import TASKS, Task
from evalkit.tasks.custom import DataTask, is_data_task, make_task, run_label
from evalkit.tasks.ppl import Perplexity

WANDB_MODES = ("auto", "off", "offline", "online")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SEED_LIMIT = 2**32
MAX_SAMPLES = 1_000_000  # samples are built before the first runs: a larger count would only hang
TOKENS = (1, TOKEN_LIMIT - 1, "more than any model's window (the limit is 2**31)")
COUNT = (1, MAX_SAMPLES, f"more than one run takes (the limit is {MAX_SAMPLES:,})")  # torch takes seeds below 2**64, and the random policy seeds each layer with seed * 100003 + layer


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
        if key.strip() in args:
            raise EvalkitError(f"{flag} {key.strip()} is given twice ({args[key.strip()]} and {value.strip()}): "
                               "give it once")
        args[key.strip()] = value.strip()
    return args


@runtime_checkable
class SizedBySettings(Protocol):
    """A task whose settings (`--task-arg`), not only `--length`, set how long its samples are (the niah grid)."""

    def longest(self, length: int) -> int: ...


def setting(default=MISSING, *, factory=MISSING, in_id: bool = True, data: bool = False, baseline: bool = False,
            after_prefill: bool = False, report: str = "setting", bounds: tuple | None = None):
    """A RunConfig field and the groups it belongs to (`fields_where` reads them):
    - in_id: can change a result, so it is part of the run id;
    - data: a data task's own (`jsonl:`, `hf:`): unset for registered tasks and then left out of the id;
    - baseline: the full-cache baseline of a run must have the same value (the same samples, decoded alike);
    - after_prefill: acts only after a full prefill, so runs that differ in nothing else share it;
    - report: how `evalkit report` reads it: "curve" (a point of a policy's curve), "variant" (how a policy
      ran: a series of its own), "ignored" (cannot change a score) or "setting" (a comparable group).
    `bounds`: (low, high, what a value above high exceeds, or how the range reads), refused in one line by
    `validate` before any work (`_check_bounds`)."""
    assert report in ("curve", "variant", "ignored", "setting")
    metadata = {"in_id": in_id, "data": data, "baseline": baseline, "after_prefill": after_prefill, "report": report,
                **({"bounds": bounds} if bounds else {})}
    return field(default=default, default_factory=factory, metadata=metadata)


@dataclass
class RunConfig:
    policy: str = setting("h2o_head", after_prefill=True, report="curve")
    budget: Budget = setting(0.2, after_prefill=True, report="curve")
    task: str = setting("ruler:niah_single_2", baseline=True)
    task_args: dict[str, str] = setting(factory=dict, baseline=True)  # task-specific settings, `--task-arg key=value`
    length: int = setting(2048, baseline=True, bounds=TOKENS)  # prompt + answer tokens per sample, fitted with the model's tokenizer
    samples: int = setting(10, baseline=True, bounds=COUNT)
    model: str = setting(DEFAULT_MODEL, baseline=True)
    layout: str = setting("paged", after_prefill=True, report="variant")
    block_size: int = setting(16, after_prefill=True, report="variant", bounds=TOKENS)
    granularity: str | None = setting(None, after_prefill=True, report="variant")  # None: the policy's own
    # hyper-parameters, `--policy-arg key=value`
    policy_args: dict[str, str] = setting(factory=dict, after_prefill=True, report="variant")
    prefill: str = setting("full", report="variant")
    chunk_size: int = setting(512, report="variant", bounds=TOKENS)
    query_aware: bool = setting(True, report="variant")
    decode_eviction: bool = setting(True, after_prefill=True, report="variant")
    # what the budget does in a sliding-window layer (Gemma 3's): "budget" caps it at min(budget, window), "window"
    # leaves it its whole window (docs/policies.md)
    sliding_layers: str = setting("budget", after_prefill=True, report="variant")
    temperature: float = setting(0.0, baseline=True, after_prefill=True, bounds=(0, math.inf, "a finite number >= 0"))
    seed: int = setting(0, baseline=True, bounds=(0, SEED_LIMIT - 1, "in [0, 2**32)"))
    batch_size: int = setting(1, in_id=False, report="ignored", bounds=COUNT)
    pool_pages: int | None = setting(None, after_prefill=True, report="variant", bounds=TOKENS)
    dtype: str = setting("auto", baseline=True)
    device: str = setting("auto", report="ignored")
    out: str = setting("runs", in_id=False, after_prefill=True, report="ignored")
    wandb: str = setting("auto", in_id=False, after_prefill=True, report="ignored")
    kernels: str = setting("auto", in_id=False, report="ignored")  # attention: auto (Triton on CUDA), triton, torch
    # Data tasks (`jsonl:PATH`, `hf:NAME[:CONFIG]:SPLIT`) only; validate() resolves them. There
    # `samples` becomes the number of records in [offset, offset + limit): data is never cut short.
    data_format: str | None = setting(None, data=True, baseline=True)  # kvpress, ruler or longbench; None/"auto": detected
    metric: str | None = setting(None, data=True, baseline=True)  # a METRICS name; None: the format's own
    limit: int | None = setting(None, data=True)  # None: every record from offset on
    offset: int | None = setting(None, data=True, baseline=True)  # None: 0
    # SHA-256 of the selected records, so an edited file is a new run
    data_sha256: str | None = setting(None, data=True, baseline=True)
    question_split: bool | None = setting(None, data=True)  # whether the data keeps the question apart from the context

    def validate(self) -> "RunConfig":
        """Every setting checked before any work (`resolve`), this config left in canonical form."""
        self.resolve()
        return self

    def resolve(self) -> "ResolvedRun":
        """Every setting checked before any work: the model's config is read (its positions), never its weights.
        The policy and the task are made here, once, and handed on to the runner with the config."""
        self.policy = POLICIES.canonical(self.policy)
        if not is_data_task(self.task):
            if self.task not in TASKS.names() and Path(self.task).is_file():
                raise EvalkitError(f"unknown task {self.task!r}; for your data file use --task jsonl:{self.task}")
            self.task = TASKS.canonical(self.task)
        self.budget = parse_budget(self.budget)
        choice("layout", self.layout, LAYOUTS)
        choice("prefill", self.prefill, ("full", "chunked"))
        choice("wandb", self.wandb, WANDB_MODES)
        choice("dtype", self.dtype, DTYPES)
        choice("kernels", self.kernels, KERNEL_MODES)
        choice("sliding layers", self.sliding_layers, SLIDING_LAYERS)
        for f in fields(self):
            if "bounds" in f.metadata and getattr(self, f.name) is not None:
                _check_bounds(f.name, getattr(self, f.name), *f.metadata["bounds"])
        check_device(self.device)
        if is_data_task(self.task):
            policy = self._checked_policy()
            task = self._resolve_data()  # it reads the data, which the checks above need not wait for
        else:
            self._refuse_data_options()
            task = make_task(self)  # its arguments refused before any of the model's files is read
            policy = self._checked_policy()
            self._check_task_fits(task)
        self._check_rope(policy)
        return ResolvedRun(self, policy, task)

    def _checked_policy(self) -> Policy:
        """The policy, its granularity and arguments checked, its budget against the length and the model."""
        policy = make_policy(self.policy, self.granularity, self.policy_args)
        refuse_contradiction(self.policy, self.granularity)
        policy.check_fits(self.length, max_positions_of(self.model))
        policy.check_budget(self.budget, self.block_size, self.length)
        return policy

    def _check_task_fits(self, task: Task) -> None:
        """The registered task's samples refused before any is built where they are longer than the model's
        positions (a haystack of a million tokens takes minutes and gigabytes to build)."""
        task.check_length(self.length)
        longest = task.longest(self.length) if isinstance(task, SizedBySettings) else self.length
        lower = "the task's lengths" if "lengths" in self.task_args else "--length"
        limit = max_positions_of(self.model)
        if limit and longest > limit:
            raise EvalkitError(f"a sample of {longest} positions (prompt + answer) does not fit, "
                               f"{self.model} has {limit}: lower {lower}")

    def _check_rope(self, policy: Policy) -> None:
        """A policy that applies the model's RoPE itself (Expected Attention's query moments and future positions,
        DuoAttention's calibration) reads one RoPE for every layer: refused on a model whose layer types rotate
        with their own (Gemma 3: sliding layers with base 10,000, global ones with 1,000,000)."""
        rope = getattr(model_config(self.model), "rope_parameters", None)
        per_layer_type = bool(rope) and isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values())
        if per_layer_type and policy.applies_model_rope:
            raise EvalkitError(f"{self.policy} reads the model's RoPE, and {self.model} has one per layer type "
                               f"({', '.join(rope)}): not supported yet")

    def _resolve_data(self) -> DataTask:
        task = DataTask(self.task, self.data_format, self.metric, self.limit, self.offset, self.task_args)
        limit = max_positions_of(self.model)  # a giant record is refused here, before any model loads or tokenises it
        task.check_sizes(*((self.length,) if not limit or self.length <= limit else
                           (limit, f"{self.model}'s window of {limit}")))
        self.task, self.data_format, self.metric = task.name, task.data_format, task.metric
        self.offset, self.samples = task.indices.start, len(task.indices)
        self.data_sha256, self.question_split = task.sha256, task.question_split
        return task

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
        """This run's full-cache baseline: policy `full` at budget 1, on the same samples and settings (a full cache
        keeps a sliding layer's window whatever `sliding_layers` says)."""
        return replace(self, policy="full", budget=1.0, granularity=None, policy_args={}, sliding_layers="budget")

    def identity(self) -> dict:
        left_out = fields_where(in_id=False) + (() if is_data_task(self.task) else fields_where(data=True))
        if not self.policy_args:  # runs without hyper-parameters keep the ids they had before the option existed
            left_out += ("policy_args",)
        if self.sliding_layers == "budget":  # and so do runs of the default, whatever their model
            left_out += ("sliding_layers",)
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}

    def run_id(self) -> str:
        """`<task>-<policy label>-<budget>-<digest>`: the label names the granularity run (`policy_label`).
        A folder that an earlier evalkit named after the policy alone (same digest) keeps its name, so
        that run resumes."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]
        task = run_label(self.task) if is_data_task(self.task) else self.task.split(":")[-1]
        label = policy_label(self.policy, self.granularity)
        run_id = f"{task}-{label}-{self.budget}-{digest}"
        earlier = f"{task}-{self.policy}-{self.budget}-{digest}"
        if earlier != run_id and (Path(self.out) / earlier).is_dir() and not (Path(self.out) / run_id).exists():
            return earlier
        return run_id

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ResolvedRun:
    """A run as `RunConfig.resolve` leaves it: the config in canonical form, and the policy and the task made
    from it while checking it (a data task's records read and hashed once), for the runner to use as they are."""

    config: RunConfig
    policy: Policy
    task: Task

    def generation_settings(self) -> GenerationSettings:
        return GenerationSettings.from_options(self.config, self.policy)

    def full_cache(self) -> "ResolvedRun":
        """This run's full-cache baseline (`RunConfig.full_cache`) on the same task object: nothing in it left to
        check that this run's checks did not."""
        return ResolvedRun(self.config.full_cache(), make_policy("full"), self.task)


def _check_bounds(name: str, value, low, high, said: str) -> None:
    """One line when `value` is outside [low, high]: `said` is what a value above exceeds ("more than ..."),
    or how the whole range reads."""
    flag = name.replace("_", "-")
    inside = low <= value <= high and (not isinstance(value, float) or math.isfinite(value))
    if inside:
        return
    if said.startswith("more than"):
        raise EvalkitError(f"{flag} must be >= {low}, got {value}" if value < low else f"{flag} {value} is {said}")
    raise EvalkitError(f"{flag} must be {said}, got {value}")


def fields_where(**role) -> tuple[str, ...]:
    """Names of the RunConfig fields in a group (`setting`): `fields_where(baseline=True)`."""
    return tuple(f.name for f in fields(RunConfig) if all(f.metadata[k] == v for k, v in role.items()))


def default_of(name: str):
    """A RunConfig field's default value (a fresh one for a dict or list field)."""
    return getattr(RunConfig(), name)


def baseline_for(config: dict, stored: list[tuple[dict, dict]]) -> dict | None:
    """The metrics of the full-cache baseline of a run with `config` (`RunConfig.to_dict()`) among `stored`
    runs ((config, metrics) pairs, in run id order): a full run with the same `baseline` fields (and, for
    perplexity, the same chunk: it scores what follows the first), the one that ran most like this run
    (the most `variant` fields equal; the first of equals); None if there is none."""
    keys = fields_where(baseline=True) + (("chunk_size",) if config.get("task") == Perplexity.name else ())
    fulls = [(other, metrics) for other, metrics in stored
             if other.get("policy") == "full" and all(other.get(k) == config.get(k) for k in keys)]
    variant = fields_where(report="variant")
    return max(fulls, key=lambda run: sum(run[0].get(k) == config.get(k) for k in variant))[1] if fulls else None


def choice(name: str, value, allowed, optional: bool = False) -> None:
    """One line naming the allowed values when `value` is not one of them."""
    if value is None and optional:
        return
    if value not in allowed:
        raise EvalkitError(f"unknown {name} {value!r}; choose from {', '.join(allowed)}")
