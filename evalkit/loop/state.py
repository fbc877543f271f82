"""The loop's state and its one forward: settings, requests, generations, `LoopState`, `forward`.

Every forward passes true `position_ids`, so eviction never shifts a token's position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from evalkit.attention import ForwardPlan, PromptRecord
from evalkit.cache import KVCache
from evalkit.models import rope_of, sliding_windows
from evalkit.policies import Budget, Policy
from evalkit.policies.query_moments import QueryMoments

NO_LIMIT = 1 << 40
SLIDING_LAYERS = ("budget", "window")  # what the budget does in a sliding-window layer (docs/policies.md)


@dataclass
class GenerationSettings:
    policy: Policy
    budget: Budget = 1.0  # `policies.budget`: a fraction of the prompt or tokens per KV head
    layout: str = "paged"
    page_size: int = 16
    prefill: str = "full"  # "full": whole prompt then compress once; "chunked": compress after every chunk
    chunk_size: int = 512
    query_aware: bool = True  # False: compress the context before the question is seen
    decode_eviction: bool = True  # keep the cache at its post-prefill size while decoding
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    pool_pages: int | None = None  # per layer; default: what the batch needs at its peak
    kernels: str = "auto"  # attention: "auto" (Triton on CUDA), "triton" or "torch"
    decode_step: str = "auto"  # "graph", "static" (`loop.static_decode`), "eager"; "auto": "graph" on CUDA, else "eager"
    # A sliding-window layer (window W) never holds a token no later query sees; its cap is "budget": min(the
    # layer's budget, W - 1), or "window": W - 1 whatever the budget, which then evicts in global layers only.
    sliding_layers: str = "budget"

    @classmethod
    def from_options(cls, options, policy: Policy, **overrides) -> GenerationSettings:
        """The settings `options` has under these fields' names (a RunConfig, lm-eval's model arguments, a
        bench's settings), `overrides` on top: the one mapping from a tool's options to the loop's."""
        taken = {f.name: getattr(options, f.name) for f in fields(cls) if f.name != "policy" and hasattr(options, f.name)}
        if hasattr(options, "block_size"):  # the options' spelling of the page size (`--block-size`)
            taken["page_size"] = options.block_size
        return cls(policy=policy, **{**taken, **overrides})


@dataclass
class Request:
    context_ids: list[int]
    question_ids: list[int]  # question and answer prefix: never compressed when query-agnostic
    max_new_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    kept_tokens: float  # mean per layer and KV head after prefill
    bytes_held: int  # KV bytes allocated to this sequence after prefill
    bytes_ideal: int  # KV bytes of the tokens it kept
    bytes_full: int  # KV bytes a full cache holds after its prompt (`full_cache_bytes`)
    attended_fraction: float  # of its live slots, the share decode attention read (1.0 but for Quest)
    timing: dict = field(default_factory=dict)  # batch-wide seconds and token counts


Observer = Callable[[str, KVCache], None]
"""Called as observe(event, cache) with event "forward" after every forward, "compressed" after every
compression (each prefill chunk, each decode step) and "prefill" once prefill is done."""


@dataclass
class ReconstructionPrompts:
    """KVzip's reconstruction prompts in a tokenizer's ids (`loop.reconstruction.reconstruction_prompts`)."""

    prefix_length: int  # chat-template tokens before the user's text: not repeated
    first: list[int]  # asks for the first chunk
    later: list[int]  # asks for a later chunk, followed by the previous chunk's last tokens
    suffix: list[int]  # the template's assistant turn, before the repeated chunk


@dataclass
class LoopState:
    model: torch.nn.Module
    cache: KVCache
    policy: Policy
    settings: GenerationSettings
    seen: torch.Tensor  # [B] tokens each sequence has fed so far
    stat_end: torch.Tensor  # [B] tokens seen at the last forward that collected a statistic
    observe: Observer | None = None
    collect: str | None = None  # statistic gathered in the current phase
    attend_filter: Callable | None = None  # decode-time read restriction (Quest)
    attended: torch.Tensor | None = None  # [B] slots read while decoding, all layers
    available: torch.Tensor | None = None  # [B] live slots while decoding, all layers
    record: PromptRecord | None = None  # a shared prefill's forward: no storage, everything recorded
    moments: list[QueryMoments] = field(default_factory=list)  # the prompt queries' moments, per skip asked for
    collect_moments: bool = False  # add this phase's queries to `moments`
    reconstruction: ReconstructionPrompts | None = None  # for a policy that `reconstructs` (KVzip)
    reconstruction_seconds: float = 0.0  # spent reconstructing (part of the prefill's seconds)
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer: W, None (global); [] = none slides


def forward(state: LoopState, tokens: list[list[int]], all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each sequence its new tokens (left-padded); returns last-token logits [B, V] and counts [B].

    With `all_logits`, the logits of every fed position instead: [B, T, V] float32, left on the
    model's device (they can be large); row b's new tokens are its last counts[b] columns.
    """
    ids, positions, plan, counts = forward_inputs(state, tokens)
    out = state.model(input_ids=ids, position_ids=positions, use_cache=False,
                      logits_to_keep=0 if all_logits else 1, evalkit_plan=plan)
    fed(state, counts)
    if all_logits:
        return out.logits.float(), counts
    return out.logits[:, -1].float().cpu(), counts


def forward_inputs(state: LoopState, tokens: list[list[int]]):
    """(ids [B, T], positions [B, T] on the model's device, the layers' ForwardPlan, counts [B]) of a forward."""
    device = state.model.device
    ids, valid, positions = left_padded(tokens, state.seen)
    positions = positions.to(device)
    moments = (state.moments, *rope_of(state.model)(positions)) if state.collect_moments and state.moments else None
    plan = ForwardPlan(state.cache, positions, valid.to(device), state.collect, state.policy.observation_window,
                       state.attend_filter, state.attended, state.available, state.settings.kernels, state.record,
                       moments)
    return ids.to(device), positions, plan, valid.sum(1)


def fed(state: LoopState, counts: torch.Tensor) -> None:
    """Account for a forward that fed `counts` [B] tokens per sequence."""
    advance(state.seen, state.stat_end, counts, scored=state.collect is not None)
    if state.observe:
        state.observe("forward", state.cache)


def advance(seen: torch.Tensor, stat_end: torch.Tensor, counts: torch.Tensor | None, scored: bool) -> None:
    """The one place the loop's counters move, in place (a static step's are captured in a CUDA graph): `seen`
    [B] by the `counts` [B] tokens a forward fed (None: one each), and, when the forward collected the
    statistic (`scored`), the statistic's end to `seen` for every sequence fed."""
    if counts is None:
        seen += 1
        if scored:
            stat_end.copy_(seen)
        return
    seen += counts
    if scored:
        stat_end.copy_(torch.where(counts > 0, seen, stat_end))


def left_padded(tokens: list[list[int]], seen: torch.Tensor):
    """ids [B, T], valid [B, T] and true positions [B, T] of rows of new tokens, padded on the left."""
    width = max(len(t) for t in tokens)
    if all(len(t) == width for t in tokens):  # no padding (every decode step): one tensor, no loop
        ids = torch.tensor(tokens, dtype=torch.long).view(len(tokens), width)
        return ids, torch.ones_like(ids, dtype=torch.bool), seen[:, None] + torch.arange(width)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    valid = torch.zeros(len(tokens), width, dtype=torch.bool)
    for b, row in enumerate(tokens):
        if row:
            ids[b, width - len(row):] = torch.tensor(row)
            valid[b, width - len(row):] = True
    positions = (seen[:, None] + valid.cumsum(1) - 1).masked_fill(~valid, 0)
    return ids, valid, positions


def new_state(model, settings: GenerationSettings, lengths: torch.Tensor, caps: torch.Tensor,
               after_prefill: torch.Tensor, observe: Observer | None, with_cache: bool = True) -> LoopState:
    """A state whose cache holds the prefill's peak (lengths [B], or caps [L, B] plus a chunk when chunked) plus
    `after_prefill` [B] more tokens per head (none yet without `with_cache`)."""
    widest = settings.policy.head_capacity(caps, lengths)
    prefill_peak = lengths if settings.prefill == "full" else torch.minimum(lengths, widest + settings.chunk_size)
    cache = new_cache(model, settings, prefill_peak, after_prefill) if with_cache else None
    start = torch.zeros(len(lengths), dtype=torch.long)
    if settings.sliding_layers not in SLIDING_LAYERS:
        raise ValueError(f"unknown sliding_layers {settings.sliding_layers!r}; choose from {', '.join(SLIDING_LAYERS)}")
    windows = sliding_windows(model.config)
    return LoopState(model, cache, settings.policy, settings, start, start.clone(), observe,
                     sliding_windows=windows if any(windows) else [])


def new_cache(model, settings: GenerationSettings, peak: torch.Tensor, after_prefill: torch.Tensor) -> KVCache:
    """A cache for `peak` [B] tokens per head during the prefill and `after_prefill` [B] more after it."""
    capacity = int((peak + after_prefill + 1).max())
    return KVCache.create(settings.layout, model.config, len(peak), capacity, settings.page_size,
                          model.dtype, model.device, settings.pool_pages)


def full_cache_bytes(state: LoopState, tokens: torch.Tensor) -> torch.Tensor:
    """[B] KV bytes a full cache holds after `tokens` [B] tokens per sequence: all of them in a global layer, the
    last W - 1 in a sliding layer of window W (what transformers' own cache keeps), every KV head."""
    windows = state.sliding_windows or [None] * len(state.cache.layers)
    return sum(tokens.clamp(max=NO_LIMIT if window is None else window - 1) * layer.token_bytes * layer.kv_heads
               for layer, window in zip(state.cache.layers, windows))


def split_prompts(requests, query_aware: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(what prefill compresses, what it appends uncompressed): the question joins the first when query-aware."""
    if query_aware:
        return [r.context_ids + r.question_ids for r in requests], [[] for _ in requests]
    return [list(r.context_ids) for r in requests], [list(r.question_ids) for r in requests]
