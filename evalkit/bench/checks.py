"""`evalkit bench`'s options, parsed and checked before any measurement: one line and exit 2 on bad input."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from evalkit.bench.cells import BenchSettings
from evalkit.cache import LAYOUTS
from evalkit.config import DTYPES, SEED_LIMIT, parse_policy_args
from evalkit.errors import EvalkitError
from evalkit.models import check_device, model_config, resolve_device, resolve_dtype
from evalkit.policies import POLICIES, make_policy, parse_budget
from evalkit.results import check_writable_folder

MIN_PROMPT_TOKENS = 32


@dataclass
class BenchGrid:
    """What the grid measures, checked: every list deduplicated in its given order (lengths ascending), and
    the model's config, device and dtype (read without loading weights)."""

    policies: list[str]  # canonical names
    budgets: list  # fractions or token counts (`parse_budget`)
    layouts: list[str]
    lengths: list[int]
    granularities: list[str | None]  # [None]: each policy's own
    model_config: object  # transformers' config of the model
    torch_device: torch.device
    torch_dtype: torch.dtype

    def spec(self) -> dict:
        """The grid as bench.json records it."""
        return {"policies": self.policies, "budgets": self.budgets, "layouts": self.layouts, "lengths": self.lengths,
                "granularities": self.granularities}


def parse_length(text: str) -> int:
    """'2048' -> 2048, '2k' -> 2048; anything else is refused."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not match or int(match.group(1)) == 0:
        raise EvalkitError(f"length must be a positive integer, optionally with k (x1024), got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def items(text: str, what: str) -> list[str]:
    """A comma-separated option's items, duplicates dropped, order kept; an empty item is refused."""
    found = [item.strip() for item in text.split(",")]
    if not all(found):
        raise EvalkitError(f"--{what} must be a comma-separated list without empty items, got {text!r}")
    return list(dict.fromkeys(found))


def check_grid(*, policies: str, policy_arg: list[str], granularities: str, budgets: str, lengths: str,
               layouts: str, out_dir: str, **settings) -> tuple[BenchSettings, BenchGrid]:
    """The grid's options (`settings`: the `BenchSettings` fields but policy_args), checked and parsed, and
    the --out folder checked."""
    settings = BenchSettings(**settings, policy_args=parse_policy_args(policy_arg))
    grid = _check(settings, policies, budgets, lengths, layouts, granularities)
    check_writable_folder(out_dir, "--out")
    return settings, grid


def _check(settings: BenchSettings, policies: str, budgets: str, lengths: str, layouts: str,
           granularities: str) -> BenchGrid:
    names = list(dict.fromkeys(POLICIES.canonical(p) for p in items(policies, "policies")))
    granularity_names = items(granularities, "granularities") if granularities.strip() else [None]
    for name in names:
        for granularity in granularity_names:
            make_policy(name, granularity, settings.policy_args)
    budget_values = list(dict.fromkeys(parse_budget(b) for b in items(budgets, "budgets")))
    layout_names = items(layouts, "layouts")
    for layout in layout_names:
        if layout not in LAYOUTS:
            raise EvalkitError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    for name in ("batch", "repeats", "block_size"):
        if getattr(settings, name) < 1:
            raise EvalkitError(f"{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    if not 0 <= settings.seed < SEED_LIMIT:
        raise EvalkitError(f"seed must be in [0, 2**32), got {settings.seed}")
    if settings.threads < 0:
        raise EvalkitError(f"threads must be >= 0 (0: one per core), got {settings.threads}")
    if settings.new_tokens < 2:
        raise EvalkitError(f"new-tokens must be >= 2 (decode steps are timed between tokens), "
                           f"got {settings.new_tokens}")
    if settings.dtype not in DTYPES:
        raise EvalkitError(f"unknown dtype {settings.dtype!r}; choose from {', '.join(DTYPES)}")
    length_values = sorted(set(parse_length(t) for t in items(lengths, "lengths")))
    for length in length_values:
        if length - settings.new_tokens < MIN_PROMPT_TOKENS:
            raise EvalkitError(f"length {length} leaves fewer than {MIN_PROMPT_TOKENS} prompt tokens after "
                               f"{settings.new_tokens} new tokens")
    config, target_device, target_dtype = _model_facts(settings)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and length_values[-1] > limit:
        raise EvalkitError(f"length {length_values[-1]} exceeds the {limit} positions of {settings.model}")
    return BenchGrid(names, budget_values, layout_names, length_values, granularity_names, config, target_device,
                     target_dtype)


def _model_facts(settings: BenchSettings):
    """(config, device, dtype) without loading weights, so a bad model or device fails before any work."""
    check_device(settings.device)
    target = resolve_device(settings.device)
    return model_config(settings.model), target, resolve_dtype(settings.dtype, target)
