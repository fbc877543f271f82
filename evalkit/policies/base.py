"""A policy = a scorer + a granularity + protected tokens. It never sees the storage layout.

The exact rules (budgets, statistics, protected tokens, selection) are docs/policies.md's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from evalkit.policies.arguments import PROMPT, arg, check_ranges, check_token_counts
from evalkit.policies.budget import Budget, check_budget
from evalkit.policies.score_input import ScoreInput
from evalkit.policies.selection import PAGE_GRANULARITIES, Granularity, keep_mask


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
    reads_query_moments: ClassVar[bool] = False  # True: the prefill sums its queries' moments (`QueryMoments`)
    applies_model_rope: ClassVar[bool] = False  # True: it rotates queries or keys with the model's one RoPE itself
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

    @property
    def holds_caps_while_decoding(self) -> bool:
        """True: with decode eviction every layer stays within its caps (one token over, as a step adds it), so a
        conversation's later turns need no room of their own (`loop.generate.start`). Not where the budget is
        pooled over layers, nor where heads keep everything (DuoAttention's retrieval heads)."""
        return not self.selects_across_layers

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

    def select(self, scores, positions, seen, caps, page_size, recent, span: int | None = None) -> torch.Tensor:
        """[B, H_kv, N] bool: the slots to keep (the shared selection at this policy's granularity; `span`:
        a static decode step's, `keep_mask`)."""
        return keep_mask(scores, positions, seen, caps, self.granularity, page_size, self.sink_tokens, recent, span)

    def attended_slots(self, layer, query, keys, positions, read_tokens, page_size) -> torch.Tensor | None:
        """For policies that restrict what a decode query reads (Quest): [B, H_kv, N] bool, else None."""
        return None

    def check(self) -> None:
        """Raise EvalkitError when a hyper-parameter is out of its declared range (`arg`)."""
        check_ranges(self)

    def check_fits(self, length: int, positions: int | None = None) -> None:
        """Refuse a token-count hyper-parameter larger than a `length`-token prompt (a window of a billion
        tokens would pool over a billion positions while decoding); `positions`: the model's, where known."""
        check_token_counts(self, length)

    def check_budget(self, budget: Budget, page_size: int, length: int) -> None:
        """Refuse a budget that keeps less than one token, or less than one page at a page granularity."""
        whole_pages = self.granularity in PAGE_GRANULARITIES and self.evicts
        check_budget(budget, length, page_size, self.granularity if whole_pages else None)


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
