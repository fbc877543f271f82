"""The `evalkit` lm-eval model's options: its model args (`AdapterConfig`, every one checked before
lm-eval indexes its tasks) and lm-eval command lines with `--model evalkit` implied.

Policy hyper-parameters (`evalkit run --policy-arg KEY=VALUE`) go in one model arg, since lm-eval
splits model args at commas and equals signs: `policy_args=window:64;kernel:5`.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from evalkit import models
from evalkit.assets import DEFAULT_MODEL
from evalkit.cache import LAYOUTS
from evalkit.config import DTYPES, SEED_LIMIT, choice
from evalkit.errors import EvalkitError
from evalkit.kernels import KERNEL_MODES
from evalkit.policies import POLICIES, make_policy, parse_budget
from evalkit.policies.names import refuse_contradiction

MODEL_NAME = "evalkit"
RESULTS_KEY = "evalkit"  # lm-eval puts get_model_info() into results["config"]: ours lives under this key
_IGNORED_ARGS = ("trust_remote_code", "max_batch_size")  # lm-eval hands these to every model
log = logging.getLogger(__name__)


@dataclass
class AdapterConfig:
    """The model args of `--model evalkit`, validated before any model is loaded."""

    pretrained: str = DEFAULT_MODEL  # embedded default, a local folder or a hub id
    tokenizer: str | None = None  # default: the model's own
    policy: str = "h2o_head"
    budget: float | int = 0.2
    granularity: str | None = None
    policy_args: dict[str, str] = field(default_factory=dict)  # from "key:value;key:value", see the module doc
    block_size: int = 16
    layout: str = "paged"
    prefill: str = "full"
    chunk_size: int = 512  # chunked prefill, and the streaming chunk of loglikelihood_rolling
    query_aware: bool = True
    question_marker: str = "\n"  # query-agnostic: the question is what follows its last occurrence
    decode_eviction: bool = True
    pool_pages: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    batch_size: int = 1
    max_length: int | None = None  # default: the model's positions
    add_bos_token: bool | None = None  # default: the tokenizer's own behaviour (as lm-eval's hf model)
    seed: int = 0
    kernels: str = "auto"  # attention: auto (Triton on CUDA), triton, torch

    @classmethod
    def from_args(cls, **args) -> "AdapterConfig":
        known = [f.name for f in fields(cls)]
        for name in list(args):
            if name in _IGNORED_ARGS:
                args.pop(name)
            elif name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise EvalkitError(f"unknown model arg {name!r} for --model {MODEL_NAME}{hint}; "
                                   f"known: {', '.join(known)}")
        return cls(**{k: v for k, v in args.items() if v is not None}).validate()

    def validate(self) -> "AdapterConfig":
        self.policy = POLICIES.canonical(str(self.policy))
        self.budget = parse_budget(self.budget)
        choice("layout", self.layout, LAYOUTS)
        choice("prefill", self.prefill, ("full", "chunked"))
        choice("dtype", self.dtype, DTYPES)
        choice("kernels", self.kernels, KERNEL_MODES)
        if isinstance(self.batch_size, str) and self.batch_size.strip().isdigit():
            self.batch_size = int(self.batch_size)
        if isinstance(self.batch_size, str):
            raise EvalkitError(f"batch_size must be an integer >= 1 (evalkit does not size batches "
                               f"automatically), got {self.batch_size!r}")
        for name in ("block_size", "chunk_size", "batch_size", "max_length", "pool_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EvalkitError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("query_aware", "decode_eviction", "add_bos_token"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise EvalkitError(f"{name} must be true or false, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise EvalkitError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        self.policy_args = policy_args_from_model_arg(self.policy_args)
        make_policy(self.policy, self.granularity, self.policy_args)  # the granularity and policy args checked
        refuse_contradiction(self.policy, self.granularity)
        self.question_marker = str(self.question_marker).encode().decode("unicode_escape")  # "\\n" from a CLI
        if not self.question_marker:
            raise EvalkitError("question_marker must not be empty")
        self.device = str(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes device=cuda:0 unless told otherwise; its hf model falls back the same way.
            log.warning("device %s requested but CUDA is not available: using the CPU", self.device)
            self.device = "cpu"
        models.check_device(self.device)
        for name in ("pretrained", "tokenizer"):
            value = getattr(self, name)
            if isinstance(value, str) and value != DEFAULT_MODEL:
                models.model_source(value)  # a missing local folder is refused here, not after loading
        return self


def policy_args_from_model_arg(value) -> dict[str, str]:
    """`"window:64;kernel:5"` (or a mapping, from JSON model args) -> {"window": "64", "kernel": "5"}."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    args = {}
    for item in filter(None, (part.strip() for part in str(value).split(";"))):
        key, sep, text = item.partition(":")
        if not sep or not key.strip():
            raise EvalkitError(f"policy_args must be KEY:VALUE pairs separated by ';' (e.g. "
                               f"policy_args=window:64;kernel:5), got {item!r}")
        args[key.strip()] = text.strip()
    return args


def default_model_folder() -> Path:
    """Where `assets.default_model_dir()` keeps the embedded default model, without making it (a download
    and a conversion, done once lm-eval has found the tasks: `lm_eval_command`)."""
    from evalkit.assets import cache_root

    return cache_root() / "models" / "SmolLM2-135M-Instruct"


def lm_eval_argv(argv: list[str]) -> tuple[list[str], bool]:
    """lm-eval's CLI arguments with `--model evalkit` implied and its model args checked now, before
    lm-eval indexes its tasks; and whether they evaluate `--model evalkit`. For the embedded default
    model, its tokenizer folder is added as `tokenizer=`: tasks that build their own data (RULER) load
    the tokenizer by that name, and the default's short name is not a hub id. `--limit` and
    `--include_path`, which lm-eval takes as they come, are checked here too."""
    import argparse

    from lm_eval._cli.utils import MergeDictAction

    argv = list(argv)
    if argv[:1] in (["ls"], ["validate"]):
        return argv, False
    head, argv = (argv[:1], argv[1:]) if argv[:1] == ["run"] else ([], argv)
    # The options that matter here, read by lm-eval's own rules for --model_args (key=val or JSON).
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    peek.add_argument("--model", "-M")
    peek.add_argument("--config", "-C")
    peek.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction)
    peek.add_argument("--tasks", "-t", nargs="+")
    peek.add_argument("--limit", "-L")
    peek.add_argument("--include_path")
    peek.add_argument("--help", "-h", action="store_true")
    try:
        known, _ = peek.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise EvalkitError(f"lm-eval: {error}") from None
    if known.limit is not None:
        try:
            limit = float(known.limit)
        except ValueError:
            limit = math.nan
        if not (math.isfinite(limit) and limit > 0):
            raise EvalkitError(f"lm-eval: --limit must be a number > 0 (examples per task, or a fraction of "
                               f"them below 1), got {known.limit!r}")
    if known.include_path is not None and not Path(known.include_path).expanduser().is_dir():
        raise EvalkitError(f"lm-eval: --include_path {known.include_path} is not a folder (of task YAML files)")
    if known.model is None and known.config is None:
        argv = ["--model", MODEL_NAME, *argv]
        known.model = MODEL_NAME
    if known.model != MODEL_NAME or known.help:
        return head + argv, False
    if not known.tasks and known.config is None:
        raise EvalkitError("lm-eval needs --tasks NAME[,NAME...] (`evalkit lm-eval ls tasks` lists them)")
    model_args = dict(known.model_args or {})
    AdapterConfig.from_args(**model_args)
    if model_args.get("pretrained", DEFAULT_MODEL) == DEFAULT_MODEL and "tokenizer" not in model_args:
        argv += ["--model_args", f"tokenizer={default_model_folder()}"]
    return head + argv, True


def take_option(argv: list[str], flag: str, default: str) -> tuple[str, list[str]]:
    """(value of `flag VALUE` or `flag=VALUE`, argv without it): evalkit's options, unknown to lm-eval."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 == len(argv):
                raise EvalkitError(f"{flag} needs a value")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return default, argv
