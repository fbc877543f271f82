"""A policy's hyper-parameters: how a field declares its range, which fields `--policy-arg` sets, and the checks
of their values (`Policy.check`, `Policy.check_fits` call these). Errors name a field as the user spelled it."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from evalkit.errors import EvalkitError
from evalkit.policies.budget import TOKEN_LIMIT

PROMPT = "the prompt"  # a hyper-parameter's upper bound: at most the run's prompt tokens (`check_token_counts`)


def arg(default, low: float, high: float | str = TOKEN_LIMIT - 1):
    """A hyper-parameter field and its range [low, high], checked by `check_ranges` (`high` = PROMPT: a token
    count no larger than the prompt, checked by `check_token_counts` once the length is known)."""
    return field(default=default, metadata={"range": (low, high)})


def policy_args(policy) -> dict[str, type]:
    """The hyper-parameters `--policy-arg` may set, with their types."""
    hints = {f.name: type(getattr(policy, f.name)) for f in dataclasses.fields(policy) if f.init}
    return {name: kind for name, kind in hints.items() if name not in ("granularity", "name")}


def check_ranges(policy) -> None:
    """Raise EvalkitError when a hyper-parameter is out of its declared range (`arg`)."""
    for name, (low, high) in _ranges(policy).items():
        value = getattr(policy, name)
        if not low <= value <= (TOKEN_LIMIT - 1 if high == PROMPT else high):
            shown = f"in [{low}, --length]" if high == PROMPT else f"in [{low}, {high}]"
            raise EvalkitError(f"{policy.name}: policy-arg {arg_name(policy, name)} must be {shown}, got {value}")


def check_token_counts(policy, length: int) -> None:
    """Refuse a token-count hyper-parameter (range up to PROMPT) larger than a `length`-token prompt."""
    for name, (low, high) in _ranges(policy).items():
        if high == PROMPT and getattr(policy, name) > length:
            raise EvalkitError(f"{policy.name}: policy-arg {arg_name(policy, name)} {getattr(policy, name)} is more "
                               f"than --length {length}: it must be in [{low}, {length}]")


def arg_name(policy, name: str) -> str:
    """The name `--policy-arg` knows a field by: as the user spelled it (`make_policy` notes it), else its short
    alias when it has one."""
    spelled = getattr(policy, "spelled_args", {})
    return spelled.get(name) or next((alias for alias, field_name in policy.arg_aliases.items()
                                      if field_name == name), name)


def _ranges(policy) -> dict[str, tuple]:
    return {f.name: f.metadata["range"] for f in dataclasses.fields(policy) if "range" in f.metadata}
