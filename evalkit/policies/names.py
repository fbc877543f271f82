"""Policy names: the registry, the presets of each scorer at each granularity and the labels of what runs
(`h2o_token` at head granularity is `h2o_head`; `random` at head_page is `random@head_page`), wrappers'
names, and `--policy-arg KEY=VALUE` parsing into a policy's fields (`make_policy`).
"""

from __future__ import annotations

import dataclasses
import math

from evalkit.errors import EvalkitError
from evalkit.policies.arguments import policy_args
from evalkit.policies.base import Policy
from evalkit.policies.selection import GRANULARITIES, Granularity
from evalkit.registry import Registry


# Wrapper prefix ("adakv", "critical") -> the scorers it wraps, for one line on `<prefix>_<anything else>`.
_WRAPPERS: dict[str, tuple[str, ...]] = {}


def _unknown_wrapping(name: str) -> str | None:
    """Why `name` is unknown when it wraps something its wrapper does not take (`critical_quest`, `adakv_full`)."""
    for prefix, scorers in _WRAPPERS.items():
        if name.startswith(prefix + "_"):
            return (f"{prefix} does not wrap {name[len(prefix) + 1:]!r}: it wraps {', '.join(scorers)} "
                    f"(e.g. {prefix}_{scorers[0]})")
    return None


POLICIES: Registry[Policy] = Registry("policy", _unknown_wrapping)
# Preset name -> (family base, granularity) and back, for the names of what runs (`policy_label`).
_PRESETS: dict[str, tuple[str, Granularity]] = {}
_PRESET_NAMES: dict[tuple[str, Granularity], str] = {}


def register_wrapper(prefix: str, scorers: tuple[str, ...]) -> None:
    """Name the scorers wrapper `prefix` wraps (its policies are `<prefix>_<scorer>`)."""
    _WRAPPERS[prefix] = scorers


def register_presets(cls: type[Policy], base: str, default: Granularity = Granularity.HEAD,
                     aliases: dict[str, tuple[str, ...]] | None = None, **fields):
    """Register `<base>_<granularity>` for every granularity; `base` itself names the `default` one."""
    aliases = {default: (base,), **(aliases or {})}
    for granularity in GRANULARITIES:
        name = f"{base}_{granularity}"
        _PRESETS[name], _PRESET_NAMES[base, granularity] = (base, granularity), name
        POLICIES.register(
            name,
            lambda g=granularity, n=name: cls(granularity=g, name=n, **fields),
            aliases=aliases.get(granularity, ()),
        )


def make_policy(name: str, granularity: str | None = None, args: dict[str, str] | None = None) -> Policy:
    """The registered policy `name`, at `granularity` if given, with hyper-parameters `args` (strings)."""
    policy = POLICIES.create(name)
    if granularity is not None:
        if granularity not in GRANULARITIES:
            raise EvalkitError(f"unknown granularity {granularity!r}; choose from {', '.join(GRANULARITIES)}")
        if granularity in policy.cannot_run_at:
            raise EvalkitError(f"{policy.name} cannot run at granularity {granularity}: "
                               f"{policy.cannot_run_at[granularity]}")
        policy.granularity = Granularity(granularity)
    if args:
        policy = dataclasses.replace(policy, **_parse_args(policy, args))
        policy.spelled_args = {policy.arg_aliases.get(key, key): key for key in args}  # for messages: as typed
    policy.check()
    return policy


def policy_label(name: str, granularity: str | None) -> str:
    """The name of what runs when policy `name` runs at `granularity` (None: its own): the preset of its
    family at that granularity (`h2o_token` at head: `h2o_head`), or `name@granularity` for a policy that
    has no presets (`random@head_page`)."""
    name = POLICIES.canonical(name)
    if granularity is None or granularity == POLICIES.create(name).granularity:
        return name
    if name in _PRESETS:
        return _PRESET_NAMES[_PRESETS[name][0], Granularity(granularity)]
    return f"{name}@{granularity}"


def policy_family(name: str, granularity: str | None) -> tuple[str, Granularity]:
    """(scorer family, granularity) of what runs: `h2o_token` at None is ("h2o", token); `random` at
    head_page is ("random", head_page)."""
    canonical = POLICIES.canonical(name)
    own = POLICIES.create(canonical).granularity
    run_at = Granularity(granularity) if granularity is not None else own
    return (_PRESETS[canonical][0] if canonical in _PRESETS else canonical), run_at


def refuse_contradiction(name: str, granularity: str | None) -> None:
    """One line when `granularity` contradicts the granularity that preset `name` says (`h2o_token` at head)."""
    canonical = POLICIES.canonical(name)
    if canonical in _PRESETS and granularity is not None and granularity in GRANULARITIES:
        label = policy_label(canonical, granularity)
        if label != canonical:
            raise EvalkitError(f"{name} runs at granularity {_PRESETS[canonical][1]}; --granularity {granularity} "
                               f"contradicts it: use --policy {label}")


def _parse_args(policy: Policy, args: dict[str, str]) -> dict:
    known = policy_args(policy)
    parsed, spelled = {}, {}
    for key, text in args.items():
        name = policy.arg_aliases.get(key, key)
        if name not in known:
            names = sorted([*known, *policy.arg_aliases])
            raise EvalkitError(f"{policy.name} has no policy-arg {key!r}; it takes: {', '.join(names)}")
        if name in spelled:
            raise EvalkitError(f"{policy.name}: policy-args {spelled[name]} and {key} both set {name} (one is the "
                               "other's alias): give one")
        parsed[name], spelled[name] = _parse_value(policy, key, name, str(text).strip(), known[name]), key
    return parsed


def _parse_value(policy: Policy, key: str, name: str, text: str, kind: type):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind is int:
            return int(text)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        raise EvalkitError(f"{policy.name}: policy-arg {key} must be {kind.__name__}, got {text!r}") from None
    choices = policy.arg_choices.get(name)
    if choices and text not in choices:
        raise EvalkitError(f"{policy.name}: policy-arg {key} must be one of {', '.join(choices)}, got {text!r}")
    return text
