"""A policy = a scorer + a granularity + protected tokens. It never sees the storage layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from evalkit.registry import Registry

GRANULARITIES = ("head", "token", "page")


@dataclass
class ScoreInput:
    """What a scorer may look at for one layer, per (sequence, KV head) slot; ragged heads padded."""

    keys: torch.Tensor  # [B, H_kv, N, D] post-RoPE keys
    positions: torch.Tensor  # [B, H_kv, N] original positions, -1 = empty slot
    attention: torch.Tensor  # [B, H_kv, N] accumulated attention statistic (zeros unless collected)
    layer: int
    seed: int


@dataclass
class Policy:
    """Base of every policy. Subclasses set the class attributes and implement `score`.

    `collect` names the attention statistic the attention function must gather for this
    policy: None, or "attention" (each query's softmax probability added to every slot it
    attends to, group-mean over the query heads of a KV head: H2O's accumulated attention).
    """

    granularity: str = "head"
    sink_tokens: int = 0  # the first positions, always kept
    recent_fraction: float = 0.0  # share of the budget given to the most recent tokens, always kept
    name: str = field(default="", compare=False)

    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    collect: ClassVar[str | None] = None
    evicts: ClassVar[bool] = True  # False: keeps everything whatever the budget

    def score(self, inp: ScoreInput) -> torch.Tensor:
        """[B, H_kv, N] higher = keep; empty slots are ignored whatever their score."""
        raise NotImplementedError


POLICIES: Registry[Policy] = Registry("policy")


def register_presets(cls: type[Policy], base: str, aliases: dict[str, tuple[str, ...]] | None = None, **fields):
    """Register `<base>_head`, `<base>_token`, `<base>_page` presets of one scorer."""
    aliases = aliases or {}
    for granularity in GRANULARITIES:
        name = f"{base}_{granularity}"
        POLICIES.register(
            name,
            lambda g=granularity, n=name: cls(granularity=g, name=n, **fields),
            aliases=aliases.get(granularity, ()),
        )


def make_policy(name: str, granularity: str | None = None) -> Policy:
    policy = POLICIES.create(name)
    if granularity is not None:
        policy.granularity = granularity
    return policy


def resolve_budget(budget: float, lengths: torch.Tensor) -> torch.Tensor:
    """[B] tokens to keep per KV head: a fraction in (0, 1] of each length, or an integer count > 1."""
    if budget <= 1:
        # Rounded first so 0.07 * 100 (= 7.000000000000001 in floating point) keeps 7, not 8.
        kept = torch.ceil((lengths.double() * budget).round(decimals=9)).long()
    else:
        kept = torch.full_like(lengths, int(budget))
    return torch.minimum(kept.clamp(min=1), lengths)
