"""A policy = a scorer + a granularity + protected tokens. It never sees the storage layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from evalkit.policies.selection import select_keep
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

    `collect_prefill` / `collect_decode` name the attention statistic the attention function
    gathers for this policy while prefilling / decoding:
    - None: nothing;
    - "attention": every query's softmax probability added to each slot it attends to (H2O);
    - "window": the probability each slot gets from the last `observation_window` queries of
      the forward, replacing the previous value (SnapKV's window; TOVA with a window of 1).
    Statistics are averaged over the query heads that share a KV head (GQA).
    """

    granularity: str = "head"
    sink_tokens: int = 0  # the first positions, always kept
    recent_fraction: float = 0.0  # share of the budget given to the most recent tokens, always kept
    recent_tokens: int = 0  # most recent tokens always kept, on top of the fraction (within the budget)
    observation_window: int = 0  # queries behind a "window" statistic
    name: str = field(default="", compare=False)

    description: ClassVar[str] = ""  # one line for `evalkit policies`
    scorer: ClassVar[str] = ""  # what a token is worth, in a few words
    paper: ClassVar[str] = ""
    saves: ClassVar[str] = "memory"  # or "bandwidth" for policies that evict nothing
    collect_prefill: ClassVar[str | None] = None
    collect_decode: ClassVar[str | None] = None
    evicts: ClassVar[bool] = True  # False: keeps everything whatever the budget
    restricts_reads: ClassVar[bool] = False  # True: `attended_slots` limits what decode queries read

    def score(self, inp: ScoreInput) -> torch.Tensor:
        """[B, H_kv, N] higher = keep; empty slots are ignored whatever their score."""
        raise NotImplementedError

    def layer_budgets(self, budget: torch.Tensor, num_layers: int) -> torch.Tensor:
        """[L, B] tokens per KV head for each layer; uniform unless an allocator says otherwise."""
        return budget.expand(num_layers, -1)

    def select(self, scores, positions, seen, budget, block_size, recent) -> torch.Tensor:
        """[B, H_kv, N] bool: the slots to keep (the shared selection at this policy's granularity)."""
        return select_keep(scores, positions, seen, budget, self.granularity, block_size, self.sink_tokens, recent)

    def attended_slots(self, query, keys, positions, budget, block_size) -> torch.Tensor | None:
        """For policies that restrict what a decode query reads (Quest): [B, H_kv, N] bool, else None."""
        return None


POLICIES: Registry[Policy] = Registry("policy")


def register_presets(cls: type[Policy], base: str, aliases: dict[str, tuple[str, ...]] | None = None, **fields):
    """Register `<base>_head` (alias `<base>`), `<base>_token`, `<base>_page` presets of one scorer."""
    aliases = {"head": (base,), **(aliases or {})}
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


def in_position_space(fn, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Apply `fn` to per-slot `values` laid out by position (`[B, H, T]`, absent tokens 0); back per slot.

    For scorers that look at neighbouring positions (pooling), whatever the storage order.
    """
    B, H, _ = values.shape
    live = positions >= 0
    T = int(positions.max()) + 1
    col = torch.where(live, positions, T)
    by_position = torch.zeros(B, H, T + 1, device=values.device).scatter(2, col, values.float().masked_fill(~live, 0))[..., :T]
    return torch.cat([fn(by_position), torch.zeros(B, H, 1, device=values.device)], dim=2).gather(2, col)
