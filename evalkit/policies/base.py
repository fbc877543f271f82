"""A policy = a scorer + a granularity + protected tokens. It never sees the storage layout.

The exact rules (budgets, statistics, protected tokens, selection) are docs/policies.md's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from evalkit.errors import EvalkitError
from evalkit.policies.budget import TOKEN_LIMIT, Budget, check_budget
from evalkit.policies.query_moments import QueryMoments
from evalkit.policies.selection import GRANULARITIES, PAGE_GRANULARITIES, Granularity, keep_mask
from evalkit.registry import Registry


@dataclass
class ScoreInput:
    """What a scorer may look at for one layer, per (sequence, KV head) slot; ragged heads padded."""

    keys: torch.Tensor | None  # [B, H_kv, N, D] post-RoPE keys; None unless the policy `reads_keys`
    positions: torch.Tensor  # [B, H_kv, N] original positions, -1 = empty slot
    attention: torch.Tensor  # [B, H_kv, N] accumulated attention statistic (zeros unless collected)
    layer: int
    seed: int
    stat_end: torch.Tensor | None = None  # [B] tokens seen at the last forward that collected the statistic
    key_norms: torch.Tensor | None = None  # [B, H_kv, N] float64 L2 norms of the keys; None unless `reads_key_norms`
    values: torch.Tensor | None = None  # [B, H_kv, N, D]; None unless `reads_values`
    caps: torch.Tensor | None = None  # [B] tokens per KV head this layer keeps (before any reallocation)
    queries: QueryMoments | None = None  # the prompt queries' moments; None unless `reads_query_moments`
    rope: Callable | None = None  # positions [B, n] -> (cos, sin) [B, n, D] of the model's RoPE (with `queries`)
    output_projection: torch.Tensor | None = None  # [hidden, H_q * D] o_proj weight; None unless `reads_output_projection`
    span: int | None = None  # a static decode step's bound on the positions (`loop.static_decode`); None: their max + 1


PROMPT = "the prompt"  # a hyper-parameter's upper bound: at most the run's prompt tokens (`check_fits`)


def arg(default, low: float, high: float | str = TOKEN_LIMIT - 1):
    """A hyper-parameter field and its range [low, high], checked by `Policy.check` (`high` = PROMPT:
    a token count no larger than the prompt, checked by `Policy.check_fits` once the length is known)."""
    return field(default=default, metadata={"range": (low, high)})


@dataclass
class Policy:
    """Base of every policy. Subclasses set the class attributes and implement `score`.

    `collect_prefill` / `collect_decode` name the attention statistic the attention function
    gathers for this policy while prefilling / decoding:
    - None: nothing;
    - "attention": every query's softmax probability added to each slot it attends to (H2O);
    - "window": the probability each slot gets from the last `observation_window` queries of
      the forward, replacing the previous value (SnapKV's window; TOVA with a window of 1).
    Statistics are averaged over the query heads that share a KV head (GQA). A policy whose
    scorer needs a statistic never evicts a token no statistic has seen: the loop protects them.

    Dataclass fields other than `granularity` and `name` are the policy's hyper-parameters,
    settable with `--policy-arg KEY=VALUE` (`arg_aliases` adds short names); each declares its range with
    `arg(default, low, high)`.
    """

    granularity: Granularity = Granularity.HEAD
    sink_tokens: int = arg(0, 0, PROMPT)  # the first positions, always kept
    recent_fraction: float = arg(0.0, 0.0, 1.0)  # share of the budget (after sinks) given to the most recent tokens
    recent_tokens: int = arg(0, 0, PROMPT)  # most recent tokens always kept, on top of the fraction (within the budget)
    observation_window: int = arg(0, 0, PROMPT)  # queries behind a "window" statistic
    name: str = field(default="", compare=False)

    description: ClassVar[str] = ""  # one line for `evalkit policies`
    scorer: ClassVar[str] = ""  # what a token is worth, in a few words
    paper: ClassVar[str] = ""
    differs: ClassVar[str] = ""  # where evalkit departs from the paper / reference code, on purpose
    kvpress: ClassVar[str] = ""  # kvpress 0.5.5's counterpart (at head granularity), if it has one
    saves: ClassVar[str] = "memory"  # or "bandwidth" for policies that evict nothing
    collect_prefill: ClassVar[str | None] = None
    collect_decode: ClassVar[str | None] = None
    evicts: ClassVar[bool] = True  # False: keeps everything whatever the budget
    restricts_reads: ClassVar[bool] = False  # True: `attended_slots` limits what decode queries read
    reads_keys: ClassVar[bool] = False  # True: `score` reads ScoreInput.keys (gathered for it only then)
    reads_key_norms: ClassVar[bool] = False  # True: `score` reads ScoreInput.key_norms (kept by the storage)
    reads_values: ClassVar[bool] = False  # True: `score` reads ScoreInput.values
    reads_query_moments: ClassVar[bool] = False  # True: the prefill sums its queries' moments (`QueryMoments`)
    applies_model_rope: ClassVar[bool] = False  # True: it rotates queries or keys with the model's one RoPE itself
    reads_output_projection: ClassVar[bool] = False  # True: `score` reads the layer's o_proj weight
    reconstructs: ClassVar[bool] = False  # True: the loop runs a context-reconstruction forward (KVzip) after the prefill
    not_static: ClassVar[str] = ""  # why its decode cannot run as a static step (`loop.static_decode`), if it cannot
    cannot_run_at: ClassVar[dict[str, str]] = {}  # granularity -> why this policy refuses it
    arg_aliases: ClassVar[dict[str, str]] = {}  # short name -> field name, for --policy-arg
    arg_choices: ClassVar[dict[str, tuple[str, ...]]] = {}  # field name -> allowed string values

    def score(self, inp: ScoreInput) -> torch.Tensor:
        """[B, H_kv, N] higher = keep; empty slots are ignored whatever their score."""
        raise NotImplementedError

    @property
    def needs_statistic(self) -> bool:
        return self.collect_prefill is not None

    @property
    def selects_across_layers(self) -> bool:
        """True: `select_layers` chooses every layer's slots at once (KVzip's budget pooled over layers)."""
        return False

    def recent_count(self, caps: torch.Tensor) -> torch.Tensor:
        """Most recent tokens protected at these caps (before clamping to it)."""
        spare = (caps - self.sink_tokens).clamp(min=0)
        return self.recent_tokens + (self.recent_fraction * spare).long()

    def prepare(self, model, tokenizer=None) -> None:
        """Called before each batch's prefill with its model (and tokenizer, None if unknown): for a policy that
        learns about the model first (DuoAttention ranks its heads). Nothing by default."""

    def layer_caps(self, tokens: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
        """caps [L, B]: the budget's `tokens` [B] per KV head spread over the layers; uniform unless an
        allocator says otherwise."""
        return tokens.expand(num_layers, -1)

    def head_capacity(self, caps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B] most tokens one KV head keeps after a compression to `caps` [L, B] (what a chunked prefill's cache
        is sized for): the widest layer's cap, unless some heads keep more (DuoAttention's retrieval heads)."""
        return caps.amax(0)

    def select(self, scores, positions, seen, caps, block_size, recent, span: int | None = None) -> torch.Tensor:
        """[B, H_kv, N] bool: the slots to keep (the shared selection at this policy's granularity; `span`:
        a static decode step's, `keep_mask`)."""
        return keep_mask(scores, positions, seen, caps, self.granularity, block_size, self.sink_tokens, recent, span)

    def attended_slots(self, layer, query, keys, positions, read_tokens, block_size) -> torch.Tensor | None:
        """For policies that restrict what a decode query reads (Quest): [B, H_kv, N] bool, else None."""
        return None

    def check(self) -> None:
        """Raise EvalkitError when a hyper-parameter is out of its declared range (`arg`)."""
        for name, (low, high) in _ranges(self).items():
            value = getattr(self, name)
            if not low <= value <= (TOKEN_LIMIT - 1 if high == PROMPT else high):
                shown = f"in [{low}, --length]" if high == PROMPT else f"in [{low}, {high}]"
                raise EvalkitError(f"{self.name}: policy-arg {_arg_name(self, name)} must be {shown}, got {value}")

    def check_fits(self, length: int, positions: int | None = None) -> None:
        """Refuse a token-count hyper-parameter larger than a `length`-token prompt (a window of a billion
        tokens would pool over a billion positions while decoding); `positions`: the model's, where known."""
        for name, (low, high) in _ranges(self).items():
            if high == PROMPT and getattr(self, name) > length:
                raise EvalkitError(f"{self.name}: policy-arg {_arg_name(self, name)} {getattr(self, name)} is more "
                                   f"than --length {length}: it must be in [{low}, {length}]")

    def check_budget(self, budget: Budget, block_size: int, length: int) -> None:
        """Refuse a budget that keeps less than one token, or less than one page at a page granularity."""
        whole_pages = self.granularity in PAGE_GRANULARITIES and self.evicts
        check_budget(budget, length, block_size, self.granularity if whole_pages else None)


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


def policy_args(policy: Policy) -> dict[str, type]:
    """The hyper-parameters `--policy-arg` may set, with their types."""
    hints = {f.name: type(getattr(policy, f.name)) for f in dataclasses.fields(policy) if f.init}
    return {name: kind for name, kind in hints.items() if name not in ("granularity", "name")}


def _ranges(policy: Policy) -> dict[str, tuple]:
    return {f.name: f.metadata["range"] for f in dataclasses.fields(policy) if "range" in f.metadata}


def _arg_name(policy: Policy, name: str) -> str:
    """The name `--policy-arg` knows a field by: as the user spelled it (`make_policy` notes it), else its short
    alias when it has one."""
    spelled = getattr(policy, "spelled_args", {})
    return spelled.get(name) or next((alias for alias, field_name in policy.arg_aliases.items()
                                      if field_name == name), name)


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


def in_position_space(fn, values: torch.Tensor, positions: torch.Tensor, span: int | None = None) -> torch.Tensor:
    """Apply `fn` to per-slot `values` laid out by position (`[B, H, T]`, absent tokens 0); back per slot.
    T = `span` when given (`ScoreInput.span`: no read back to the host), else the last position + 1.

    For scorers that look at neighbouring positions (pooling), whatever the storage order.
    """
    B, H, _ = values.shape
    live = positions >= 0
    T = int(positions.max()) + 1 if span is None else span
    col = torch.where(live, positions, T)
    by_position = torch.zeros(B, H, T + 1, device=values.device).scatter(2, col, values.float().masked_fill(~live, 0))[..., :T]
    return torch.cat([fn(by_position), torch.zeros(B, H, 1, device=values.device)], dim=2).gather(2, col)
