"""A sweep's plan (`SweepPlan`): policies × budgets × tasks × lengths as cells, from defaults, a config file
and flags.

A cell (`SweepCell`) is one RunConfig with its own run folder, keyed by its run id (cells that share their
samples run together through `runner.run_many`, one prefill per sample), so the results store
gives crash safety for free: a complete run folder (metrics.json present) is skipped and a
partial one resumes sample by sample. Every (task, length) also gets its full-cache
baseline (policy `full`, budget 1), computed once and shared by all cells of that setting.
Running the cells: `evalkit.sweep.engines`; the command: `evalkit.sweep.command`.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import typer

from evalkit.config import ResolvedRun, RunConfig, baseline_for, parse_policy_args, parse_task_args
from evalkit.errors import EvalkitError
from evalkit.models import model_source
from evalkit.policies import fraction_of, parse_budget
from evalkit.policies.names import policy_family, policy_label
from evalkit.results import RunDir
from evalkit.runner import prefill_key
from evalkit.tasks.custom import is_data_task
from evalkit.tasks.ppl import Perplexity

ENGINES = ("local", "ray")
# A plan is checked cell by cell before anything runs (a few ms a cell): past this many, a typo in a list of
# lengths or budgets would keep `--dry-run` busy for minutes before it printed anything. The study's largest
# grid has 128.
MAX_CELLS = 10_000


@dataclass
class SweepCell:
    """One run of the grid (or a full-cache baseline) as planning resolved it, and so its run id and folder."""

    run: ResolvedRun
    baseline: bool
    policy: str  # what the grid calls it: the policy's label and its own args (`kvzip_head:layerwise=true`)

    @property
    def config(self) -> RunConfig:
        return self.run.config

    @property
    def run_id(self) -> str:
        return self.config.run_id()

    def label(self) -> str:
        return f"{self.config.task} @ {self.config.length}: {self.policy} @ {self.config.budget}"


@dataclass
class SweepPlan:
    """Every cell of a sweep, validated, with the settings they came from and how they run."""

    cells: list[SweepCell]
    settings: dict  # the resolved sweep settings, as recorded in sweep.json and W&B
    out: str
    engine: str
    ray_address: str | None

    @property
    def sweep_id(self) -> str:
        digest = hashlib.sha256("\n".join(sorted(c.run_id for c in self.cells)).encode()).hexdigest()[:8]
        return f"sweep-{digest}"


# ---- settings: defaults <- config file <- command-line flags ------------------------------------------

_GRID_KEYS = ("policies", "budgets", "tasks", "length")
_NOT_SETTINGS = ("config_file", "dry_run", "detect")  # how the command runs, not what it runs


def resolve_settings(ctx: typer.Context, config_file: Path | None) -> dict:
    """The sweep's settings: the command's defaults, overridden by the config file, overridden by the flags
    given."""
    params = {p.name: p for p in ctx.command.params if p.name not in _NOT_SETTINGS}
    settings = {name: value for name, value in ctx.params.items() if name in params}
    if config_file is None:
        return settings
    # A file key is a flag's name (`format`, `block-size`) or its parameter's (`data_format`, `block_size`).
    by_flag = {opt.lstrip("-").replace("-", "_"): name for name, p in params.items() for opt in p.opts}
    spelled = {"task_args": "task_arg", "policy_args": "policy_arg"}  # RunConfig's names -> the flags'
    extra_fields = {f.name for f in fields(RunConfig)} - set(params) - {"policy", "budget", "task", *spelled}
    for key, value in read_config_file(config_file).items():
        name = key.replace("-", "_")
        name = spelled.get(name, by_flag.get(name, name))
        if name in spelled.values() and isinstance(value, dict):  # KEY=VALUE settings as a mapping
            value = [f"{k}={v}" for k, v in value.items()]
        if name in params:
            if ctx.get_parameter_source(name).name != "DEFAULT":  # a flag on the command line wins
                continue
            if name in _GRID_KEYS and isinstance(value, list):
                value = ",".join(str(item) for item in value)
            try:  # the flag's own type converts and checks the file's value
                settings[name] = params[name].process_value(ctx, value)
            except typer.BadParameter as error:
                raise EvalkitError(f"config file {config_file}: {key}: {error.message}") from None
        elif name in extra_fields:  # RunConfig fields without a flag pass through as written
            settings[name] = value
        else:
            known = sorted({*by_flag, *extra_fields, *spelled})
            raise EvalkitError(f"config file {config_file}: unknown key {key!r}; known: {', '.join(known)}")
    return settings


def read_config_file(path: Path) -> dict:
    """A mapping from a .yaml/.yml, .toml or .json file; anything unreadable is one clear error."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise EvalkitError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EvalkitError(f"config file {path} is not UTF-8 text (byte {raw[error.start]:#04x} at offset "
                           f"{error.start})") from None
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise EvalkitError(f"config file {path}: unknown format {suffix or '(no suffix)'!r}; "
                           "use .yaml, .yml, .toml or .json")
    try:
        if suffix == ".toml":  # TOML refuses a repeated key itself, and has no aliases
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_repeated_keys)
        else:
            data = _load_yaml(text)
    except EvalkitError as error:
        raise EvalkitError(f"config file {path}: {error}") from None
    except Exception as error:  # each parser has its own error type; all mean "not valid <format>"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise EvalkitError(f"cannot parse config file {path}: {reason}") from None
    if not isinstance(data, dict):
        raise EvalkitError(f"config file {path} must hold a mapping of option names to values")
    return data


def _no_repeated_keys(pairs: list[tuple]) -> dict:
    """A mapping in which no key is said twice (the parsers' own default: the last one silently wins)."""
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise EvalkitError(f"key {twice!r} is given twice")
    return dict(pairs)


def _load_yaml(text: str):
    """safe_load without aliases (`*name`): a config needs none, and a few hundred bytes of nested aliases
    expand to billions of items (the "billion laughs"); nor repeated keys."""
    import yaml  # not a declared dependency (transformers brings it): imported for a YAML file only

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                alias = self.peek_event()
                raise EvalkitError(f"YAML alias *{alias.anchor} on line {alias.start_mark.line + 1}: a config takes "
                                   "no aliases; write the values out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            return _no_repeated_keys([(self.construct_object(key, deep=deep), self.construct_object(value, deep=deep))
                                      for key, value in node.value])

    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def _split(value, flag: str) -> list[str]:
    items = [item.strip() for item in str(value).split(",")]
    if not any(items):
        raise EvalkitError(f"--{flag} is empty: give a comma-separated list")
    if not all(items):
        raise EvalkitError(f"--{flag} has an empty item in {str(value)!r}: remove the extra comma")
    return items


# ---- the plan -------------------------------------------------------------------------------------------

def plan_sweep(settings: dict) -> SweepPlan:
    """Every cell, validated, before anything runs: bad input never leaves a half-run grid."""
    settings = dict(settings)
    policies = _split(settings.pop("policies"), "policies")
    budgets = [parse_budget(b) for b in _split(settings.pop("budgets"), "budgets")]
    tasks = _split(settings.pop("tasks"), "tasks")
    lengths = []
    for item in _split(settings.pop("length"), "length"):
        if not item.isdigit():
            raise EvalkitError(f"--length takes whole numbers of tokens, got {item!r}")
        lengths.append(int(item))
    planned = len(tasks) * len(lengths) * (len(policies) * len(budgets) + 1)
    if planned > MAX_CELLS:
        raise EvalkitError(f"the grid has {planned:,} cells (with each task and length's full cache), more than "
                           f"{MAX_CELLS:,}: split it into several sweeps")
    engine, ray_address = settings.pop("engine"), settings.pop("ray_address")
    if engine not in ENGINES:
        raise EvalkitError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    task_args, policy_args = parse_task_args(settings.pop("task_arg")), parse_policy_args(settings.pop("policy_arg"))
    base = {k: v for k, v in settings.items() if v is not None or k not in _UNSET_MEANS_DEFAULT}
    base["task_args"], base["policy_args"] = task_args, policy_args
    variants = [policy_variant(item, base) for item in policies]
    model_source(base["model"])  # a missing local model is refused before the first cell
    _refuse_unused(base, tasks)

    cells: dict[str, SweepCell] = {}
    for task in tasks:
        # --samples sizes registered tasks; --limit/--offset/--format/--metric select from data files.
        unused = _DATA_OPTIONS if not is_data_task(task) else ("samples",)
        for length in lengths:
            fields_here = {k: v for k, v in base.items() if k not in unused}
            baseline = RunConfig(**fields_here, task=task, length=length).full_cache()
            grid = [RunConfig(**{**fields_here, **variant}, budget=budget, task=task, length=length)
                    for variant in variants for budget in budgets]
            for config, is_baseline in [(baseline, True)] + [(c, False) for c in grid]:
                resolved = config.resolve()
                label = "full" if is_baseline else _label(config, base["policy_args"])
                cells.setdefault(config.run_id(), SweepCell(resolved, is_baseline, label))
    grid = [c for c in cells.values() if not c.baseline]
    resolved = {"policies": list(dict.fromkeys(c.policy for c in grid)), "budgets": budgets,  # canonical labels
                "tasks": list(dict.fromkeys(c.config.task for c in cells.values())), "lengths": lengths, **base}
    return SweepPlan(list(cells.values()), resolved, base["out"], engine, ray_address)


def policy_variant(item: str, base: dict) -> dict:
    """A `--policies` item's RunConfig fields: `name`, `name@granularity` (`duo_attention@head_page`, as the
    report labels it), and `:KEY=VALUE` policy args after either (`kvzip_head:layerwise=true`), which join the
    sweep's own `--policy-arg`s. Said twice (the granularity, a key) is refused rather than one silently
    winning."""
    name, *args = item.split(":")
    name, at, granularity = name.partition("@")
    variant = {"policy": name.strip()}
    if at:
        if base.get("granularity") is not None:
            raise EvalkitError(f"--policies item {item!r} names a granularity and --granularity "
                               f"{base['granularity']} gives every policy one: give one of them")
        variant["granularity"] = granularity.strip()
    if args:
        own = parse_policy_args(args)
        twice = sorted(set(own) & set(base["policy_args"]))
        if twice:
            raise EvalkitError(f"--policies item {item!r} sets {twice[0]}, which --policy-arg sets too: give it once")
        variant["policy_args"] = {**base["policy_args"], **own}
    return variant


def _label(config: RunConfig, sweep_args: dict) -> str:
    own = {k: v for k, v in config.policy_args.items() if k not in sweep_args}
    return policy_label(config.policy, config.granularity) + "".join(f":{k}={v}" for k, v in own.items())


_DATA_OPTIONS = ("data_format", "metric", "limit", "offset")
_UNSET_MEANS_DEFAULT = ("samples", *_DATA_OPTIONS)  # None: RunConfig's own default


def _refuse_unused(base: dict, tasks: list[str]) -> None:
    """An option that applies to none of the grid's tasks is a mistake, as it is for `evalkit run`."""
    flags = {"data_format": "format", "metric": "metric", "limit": "limit", "offset": "offset"}
    if not any(is_data_task(t) for t in tasks):
        for name, flag in flags.items():
            if base.get(name) is not None:
                raise EvalkitError(f"--{flag} is for data tasks (jsonl:PATH, hf:NAME[:CONFIG]:SPLIT), and none of "
                                   f"{', '.join(tasks)} is one")
    if base.get("samples") is not None and all(is_data_task(t) for t in tasks):
        raise EvalkitError("--samples is not for data tasks: they run every record in "
                           "[--offset, --offset + --limit); use --limit N")


def prefill_groups(plan: SweepPlan) -> list[list[SweepCell]]:
    """The cells that share one prefill per sample (same prompts, full prefill, local engine; perplexity: the
    same passages, streamed together), in plan order; a cell that cannot share (chunked prefill, the Ray
    engine) is a group of its own."""
    groups: dict[tuple, list[SweepCell]] = {}
    for cell in plan.cells:
        key = prefill_key(cell.config) if plan.engine == "local" else None
        groups.setdefault(key or (cell.run_id,), []).append(cell)
    return list(groups.values())


def prefill_notes(plan: SweepPlan) -> dict[str, str]:
    """How each cell's prompts are prefilled, by run id, for --dry-run."""
    notes = {}
    for group in prefill_groups(plan):
        for cell in group:
            if plan.engine != "local":
                notes[cell.run_id] = "own (one Ray task per cell)"
            elif prefill_key(cell.config) is None:
                notes[cell.run_id] = "own (chunked prefill)"
            elif cell.config.task == Perplexity.name:
                notes[cell.run_id] = f"streamed with {len(group)} cells" if len(group) > 1 else "own (nothing to share)"
            else:
                notes[cell.run_id] = f"shared by {len(group)} cells" if len(group) > 1 else "own (nothing to share)"
    return notes


# ---- what a sweep reports -----------------------------------------------------------------------------

def cell_summary(cell: SweepCell) -> dict:
    c = cell.config
    return {"run_id": cell.run_id, "task": c.task, "length": c.length, "policy": cell.policy, "budget": c.budget,
            "baseline": cell.baseline}


def sweep_rows(plan: SweepPlan) -> list[dict]:
    """One row per complete non-baseline cell: its numbers and its score relative to the full cache."""
    baselines = [(cell.config.to_dict(), RunDir(plan.out, cell.run_id).metrics())
                 for cell in sorted(plan.cells, key=lambda cell: cell.run_id)
                 if cell.baseline and RunDir(plan.out, cell.run_id).complete]
    rows = []
    for cell in plan.cells:
        run_dir = RunDir(plan.out, cell.run_id)
        if cell.baseline or not run_dir.complete:
            continue
        m, c = run_dir.metrics(), cell.config
        base = baseline_for(c.to_dict(), baselines)
        scorer, granularity = policy_family(c.policy, c.granularity)
        rows.append({
            "run_id": cell.run_id, "task": c.task, "length": c.length, "policy": cell.policy, "budget": c.budget,
            "scorer": scorer, "granularity": granularity.value, "query_aware": c.query_aware, "model": c.model,
            "budget_fraction": fraction_of(c.budget, m.get("prompt_tokens")), "score": m["score"],
            "full_cache_score": base["score"] if base else None,
            "relative_score": m["score"] / base["score"] if base and base["score"] else None,
            "held_over_full": m["held_over_full"], "bytes_held": m["bytes_held"], "kept_tokens": m["kept_tokens"],
            "prefill_tokens_per_s": m["prefill_tokens_per_s"], "decode_tokens_per_s": m["decode_tokens_per_s"],
        })
    return rows
