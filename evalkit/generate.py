"""The generation loop: prefill (compressing as the policy says), then decode, with our own cache.

Read top to bottom: `generate` → `prefill` → `compress` → `decode`. Every forward
passes true `position_ids`, so eviction never shifts a token's position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from evalkit.attention import ForwardPlan, evalkit_attention
from evalkit.cache import KVCache, model_kv_shape
from evalkit.policies import Policy, ScoreInput, resolve_budget

NO_LIMIT = 1 << 40


@dataclass
class GenerationSettings:
    policy: Policy
    budget: float = 1.0
    layout: str = "paged"
    block_size: int = 16
    prefill: str = "full"  # "full": whole prompt then compress once; "chunked": compress after every chunk
    chunk_size: int = 512
    query_aware: bool = True  # False: compress the context before the question is seen
    decode_eviction: bool = True  # keep the cache at its post-prefill size while decoding
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    pool_pages: int | None = None  # per layer; default: what the batch needs at its peak


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
    bytes_full: int  # KV bytes of its whole prompt in a full cache
    attended_fraction: float  # of its live slots, the share decode attention read (1.0 but for Quest)
    timing: dict = field(default_factory=dict)  # batch-wide seconds and token counts


Observer = Callable[[str, KVCache], None]
"""Called as observe(event, cache) with event "forward" after every forward and "prefill" once prefill is done."""


@dataclass
class _State:
    model: torch.nn.Module
    cache: KVCache
    policy: Policy
    settings: GenerationSettings
    seen: torch.Tensor  # [B] tokens each sequence has fed so far
    observe: Observer | None = None
    collect: str | None = None  # statistic gathered in the current phase
    attend_filter: Callable | None = None  # decode-time read restriction (Quest)
    attended: torch.Tensor | None = None  # [B] slots read while decoding, all layers
    available: torch.Tensor | None = None  # [B] live slots while decoding, all layers


def forward(state: _State, tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each sequence its new tokens (left-padded); returns last-token logits [B, V] and counts [B]."""
    device = state.model.device
    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    valid = torch.zeros(len(tokens), width, dtype=torch.bool)
    for b, row in enumerate(tokens):
        if row:
            ids[b, width - len(row):] = torch.tensor(row)
            valid[b, width - len(row):] = True
    positions = (state.seen[:, None] + valid.cumsum(1) - 1).masked_fill(~valid, 0)
    plan = ForwardPlan(state.cache, positions.to(device), valid.to(device), state.collect,
                       state.policy.observation_window, state.attend_filter, state.attended, state.available)
    out = state.model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False,
                      logits_to_keep=1, evalkit_plan=plan)
    counts = valid.sum(1)
    state.seen += counts
    if state.observe:
        state.observe("forward", state.cache)
    return out.logits[:, -1].float().cpu(), counts


def compress(state: _State, budgets: torch.Tensor) -> None:
    """Evict down to `budgets[l, b]` tokens per head in layer l, as the policy chooses."""
    policy = state.policy
    for layer_idx, layer in enumerate(state.cache.layers):
        budget = budgets[layer_idx]
        if bool((layer.live_counts() <= budget[:, None]).all()):
            continue
        recent = policy.recent_tokens + (policy.recent_fraction * (budget - policy.sink_tokens).clamp(min=0)).long()
        view = layer.read()
        scores = policy.score(ScoreInput(view.k, view.pos, view.stats, layer_idx, state.settings.seed))
        keep = policy.select(scores.cpu(), view.pos.cpu(), state.seen, budget, state.settings.block_size,
                             torch.minimum(recent, budget))
        layer.evict(view.index, keep.to(view.index.device))


def prefill(state: _State, compressed: list[list[int]], appended: list[list[int]], budget: torch.Tensor):
    """Prefill `compressed` (in chunks when chunked), compressing to `budget` [L, B]; then `appended` as is."""
    settings = state.settings
    longest = max(len(t) for t in compressed)
    chunk = settings.chunk_size if settings.prefill == "chunked" else longest
    logits = None
    for start in range(0, longest, chunk):
        step_logits, counts = forward(state, [t[start:start + chunk] for t in compressed])
        logits = step_logits if logits is None else torch.where(counts[:, None] > 0, step_logits, logits)
        compress(state, budget)
    if any(appended):
        step_logits, counts = forward(state, appended)
        logits = torch.where(counts[:, None] > 0, step_logits, logits)
    state.cache.compact()
    if state.observe:
        state.observe("prefill", state.cache)
    return logits


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def _stop_text(text: str, stops: tuple[str, ...]) -> str | None:
    cuts = [text.index(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else None


def decode(state: _State, logits: torch.Tensor, requests: list[Request], tokenizer, eos_ids: set[int],
           cap: torch.Tensor, evict: bool) -> tuple[list[list[int]], list[str]]:
    """Generate until EOS, a stop string or max new tokens; evict down to `cap` [L, B] after each step."""
    B = len(requests)
    outputs: list[list[int]] = [[] for _ in range(B)]
    texts: list[str | None] = [None] * B
    generator = torch.Generator().manual_seed(state.settings.seed)
    while True:
        chosen = _next_tokens(logits, state.settings.temperature, generator).tolist()
        for b, token in enumerate(chosen):
            if texts[b] is not None:
                continue
            request = requests[b]
            if token in eos_ids:
                texts[b] = _text(tokenizer, outputs[b])
                continue
            outputs[b].append(token)
            if request.stop:
                texts[b] = _stop_text(_text(tokenizer, outputs[b]), request.stop)
            if texts[b] is None and len(outputs[b]) >= request.max_new_tokens:
                texts[b] = _text(tokenizer, outputs[b])
        if all(t is not None for t in texts):
            return outputs, texts
        # Finished sequences keep feeding their last token; their outputs are no longer read.
        logits, _ = forward(state, [[token] for token in chosen])
        if evict:
            compress(state, cap)


@torch.inference_mode()
def generate(model, tokenizer, requests: list[Request], settings: GenerationSettings,
             observe: Observer | None = None) -> list[Generation]:
    """Generate answers for a batch of requests under one policy and budget."""
    policy = settings.policy
    if settings.query_aware:
        compressed = [r.context_ids + r.question_ids for r in requests]
        appended = [[] for _ in requests]
    else:
        compressed = [list(r.context_ids) for r in requests]
        appended = [list(r.question_ids) for r in requests]
    lengths = torch.tensor([len(t) for t in compressed])
    budget = resolve_budget(settings.budget, lengths)
    evicting = (budget < lengths) & policy.evicts
    num_layers = model_kv_shape(model.config)[0]
    # A sequence at full budget is never evicted, not even while decoding.
    budgets = torch.where(evicting, torch.minimum(policy.layer_budgets(budget, num_layers), lengths), NO_LIMIT)
    extra = torch.tensor([len(t) for t in appended])
    max_new = torch.tensor([r.max_new_tokens for r in requests])
    widest = budgets.amax(0)
    prefill_peak = lengths if settings.prefill == "full" else torch.minimum(lengths, widest + settings.chunk_size)
    capacity = int((prefill_peak + extra + max_new + 1).max())

    cache = KVCache.create(settings.layout, model.config, len(requests), capacity, settings.block_size,
                           model.dtype, model.device, settings.pool_pages)
    state = _State(model, cache, policy, settings, torch.zeros(len(requests), dtype=torch.long), observe)
    eos_ids = _eos_ids(model, tokenizer)

    with evalkit_attention(model):
        start = time.perf_counter()
        state.collect = policy.collect_prefill if bool(evicting.any()) else None
        logits = prefill(state, compressed, appended, budgets)
        prefill_seconds = time.perf_counter() - start
        kept = cache.kept_tokens().float().mean(dim=(0, 2))
        held, ideal = cache.bytes_held(), cache.bytes_ideal()

        start = time.perf_counter()
        decode_evicts = bool(evicting.any()) and settings.decode_eviction
        state.collect = policy.collect_decode if decode_evicts else None
        if policy.restricts_reads:
            read_budget = torch.where(budget < lengths, budget + extra, NO_LIMIT)
            state.attend_filter = lambda query, keys, positions: policy.attended_slots(
                query, keys, positions, read_budget, settings.block_size)
        state.attended, state.available = torch.zeros(len(requests)), torch.zeros(len(requests))
        outputs, texts = decode(state, logits, requests, tokenizer, eos_ids, budgets + extra, decode_evicts)
        decode_seconds = time.perf_counter() - start

    timing = {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds,
              "prompt_tokens": int((lengths + extra).sum()), "new_tokens": sum(len(o) for o in outputs)}
    read = torch.where(state.available > 0, state.attended / state.available.clamp(min=1), 1.0)
    return [
        Generation(outputs[b], texts[b], int(lengths[b] + extra[b]), float(kept[b]), int(held[b]), int(ideal[b]),
                   int(lengths[b] + extra[b]) * cache.bytes_per_token(), float(read[b]), timing)
        for b in range(len(requests))
    ]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
