"""The generation loop: prefill (compressing as the policy says), then decode, with our own cache.

Read: `generate` → `start` (`prefill`, `compress`) → `Decoding` (a step: pick the tokens, `forward`
them, evict). Every forward passes true `position_ids`, so eviction never shifts a token's position.
Teacher forcing through the same cache: `evalkit.teacher_forcing`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from evalkit.attention import ForwardPlan, PromptRecord, evalkit_attention
from evalkit.cache import KVCache, model_kv_shape
from evalkit.policies import PAGE_GRANULARITIES, Policy, ScoreInput, resolve_budget

if TYPE_CHECKING:
    from evalkit.shared_prefill import SharedPrefill

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
    kernels: str = "auto"  # attention: "auto" (Triton on CUDA), "triton" or "torch"


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
"""Called as observe(event, cache) with event "forward" after every forward, "compressed" after every
compression (each prefill chunk, each decode step) and "prefill" once prefill is done."""


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
    plan = ForwardPlan(state.cache, positions.to(device), valid.to(device), state.collect,
                       state.policy.observation_window, state.attend_filter, state.attended, state.available,
                       state.settings.kernels, state.record)
    return ids.to(device), positions.to(device), plan, valid.sum(1)


def fed(state: LoopState, counts: torch.Tensor) -> None:
    """Account for a forward that fed `counts` [B] tokens per sequence."""
    state.seen += counts
    if state.collect is not None:
        state.stat_end = torch.where(counts > 0, state.seen, state.stat_end)
    if state.observe:
        state.observe("forward", state.cache)


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


def compress(state: LoopState, budgets: torch.Tensor) -> None:
    """Evict down to `budgets[l, b]` tokens per head in layer l, as the policy chooses (`select_kept`)."""
    for layer, chosen in zip(state.cache.layers, select_kept(state, state.cache.layers, budgets)):
        if chosen is not None:
            layer.evict(*chosen)
    if state.observe:
        state.observe("compressed", state.cache)


def _padded_to(x: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """x [..., n] widened to [..., width] with `fill`; x itself when already that wide (no copy)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]), value=fill)


def select_kept(state: LoopState, layers, budgets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer of `layers` (a cache's, or the same tokens stored elsewhere): (slot index, keep) [B, H_kv, N]
    each, the slots the policy keeps at `budgets[l, b]` tokens per head, or None when it holds no more.

    Tokens fed since the last statistic was collected have no score: a policy that needs one
    keeps them, as the most recent tokens (docs/policies.md). Each layer is scored on its own;
    selection never mixes the rows of a batch, so the layers' rows are selected in one call.
    """
    policy = state.policy
    unscored = state.seen - state.stat_end if policy.needs_statistic else torch.zeros_like(state.seen)
    recents = torch.minimum(policy.recent_count(budgets) + unscored, budgets)  # [L, B]
    over = []  # (layer index, slot index, positions, scores; [B, H_kv, N] each) of the layers over budget
    fewest_kept = budgets.amin(1).tolist()  # [L]
    for layer_idx, layer in enumerate(layers):
        view = layer.read(trim=True)
        within = view.index.shape[-1] <= fewest_kept[layer_idx] if view.all_live else \
            bool(((view.pos >= 0).sum(-1).cpu() <= budgets[layer_idx][:, None]).all())  # all_live: each head holds N
        if within:
            continue
        keys = view.k if policy.reads_keys else None
        key_norms = view.key_norms if policy.reads_key_norms else None
        scores = policy.score(ScoreInput(keys, view.pos, view.stats, layer_idx, state.settings.seed, state.stat_end,
                                         key_norms))
        over.append((layer_idx, view.index, view.pos, scores))  # not the view: it may hold the keys
    chosen: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layers)
    if over:
        layer_ids, indexes, positions, scores = (list(column) for column in zip(*over))
        width = max(index.shape[-1] for index in indexes)  # ragged layers padded with empty slots
        keep = policy.select(torch.cat([_padded_to(x, width) for x in scores]).cpu(),
                             torch.cat([_padded_to(pos, width, -1) for pos in positions]).cpu(),
                             state.seen.repeat(len(over)), budgets[layer_ids].reshape(-1), state.settings.block_size,
                             recents[layer_ids].reshape(-1))  # [layers * B, H_kv, width]
        for layer_idx, index, rows in zip(layer_ids, indexes, keep.split(len(state.seen))):
            chosen[layer_idx] = (index, rows[..., :index.shape[-1]].to(index.device))
    return chosen


def prefill(state: LoopState, compressed: list[list[int]], appended: list[list[int]], budget: torch.Tensor,
            appended_collect: str | None, shared: SharedPrefill | None = None):
    """Prefill `compressed` (in chunks when chunked; taken from `shared` when given), compressing to
    `budget` [L, B]; then `appended` as is, collecting `appended_collect` for it (the question after
    compression is read like decoded tokens)."""
    settings = state.settings
    longest = max(len(t) for t in compressed)
    chunk = settings.chunk_size if settings.prefill == "chunked" else longest
    if shared is not None:
        logits = shared.fork_into(state)
        compress(state, budget)
    else:
        logits = None
        for start in range(0, longest, chunk):
            step_logits, counts = forward(state, [t[start:start + chunk] for t in compressed])
            logits = step_logits if logits is None else torch.where(counts[:, None] > 0, step_logits, logits)
            compress(state, budget)
    if any(appended):
        state.collect = appended_collect
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


class Decoding:
    """One batch under one policy and budget, from the end of its prefill to its last token.

    `generate` steps one; `joint_decode.generate_cells` steps several (a sweep's cells) through one
    forward per step. A step: `next_tokens` picks each sequence's token from the last logits (None once
    every sequence is done), the caller feeds them, `advance` takes the new logits and evicts down to
    `cap` [L, B] (decode eviction).
    """

    def __init__(self, state: LoopState, requests: list[Request], tokenizer, logits: torch.Tensor,
                 cap: torch.Tensor, evict: bool, prompt_tokens: torch.Tensor, prefill_seconds: float):
        self.state, self.requests, self.tokenizer = state, requests, tokenizer
        self.logits, self.cap, self.evict = logits, cap, evict
        # What the prefill left, reported with every generation: [B] each.
        self.prompt_tokens, self.prefill_seconds = prompt_tokens, prefill_seconds  # compressed + appended
        self.kept = state.cache.kept_tokens().float().mean(dim=(0, 2))  # mean per layer and KV head
        self.held, self.ideal = state.cache.bytes_held(), state.cache.bytes_ideal()
        self.eos_ids = _eos_ids(state.model, tokenizer)
        self.outputs: list[list[int]] = [[] for _ in requests]
        self.texts: list[str | None] = [None] * len(requests)
        self.generator = torch.Generator().manual_seed(state.settings.seed)

    def next_tokens(self) -> list[list[int]] | None:
        """The next token to feed each sequence, or None once every sequence has finished (EOS, a stop
        string or max new tokens). Finished sequences keep feeding their last token; their outputs are
        no longer read."""
        chosen = _next_tokens(self.logits, self.state.settings.temperature, self.generator).tolist()
        for b, token in enumerate(chosen):
            if self.texts[b] is not None:
                continue
            request, output = self.requests[b], self.outputs[b]
            if token in self.eos_ids:
                self.texts[b] = _text(self.tokenizer, output)
                continue
            output.append(token)
            if request.stop:
                self.texts[b] = _stop_text(_text(self.tokenizer, output), request.stop)
            if self.texts[b] is None and len(output) >= request.max_new_tokens:
                self.texts[b] = _text(self.tokenizer, output)
        if all(t is not None for t in self.texts):
            return None
        return [[token] for token in chosen]

    def advance(self, logits: torch.Tensor) -> None:
        """Take the logits of the tokens just fed; evict (decode eviction)."""
        self.logits = logits
        if self.evict:
            compress(self.state, self.cap)

    def generations(self, decode_seconds: float) -> list[Generation]:
        timing = {"prefill_seconds": self.prefill_seconds, "decode_seconds": decode_seconds,
                  "prompt_tokens": int(self.prompt_tokens.sum()), "new_tokens": sum(len(o) for o in self.outputs)}
        attended, available = self.state.attended, self.state.available
        read = torch.where(available > 0, attended / available.clamp(min=1), 1.0)
        per_token = self.state.cache.bytes_per_token()
        return [Generation(self.outputs[b], self.texts[b], int(self.prompt_tokens[b]), float(self.kept[b]),
                           int(self.held[b]), int(self.ideal[b]), int(self.prompt_tokens[b]) * per_token,
                           float(read[b]), timing)
                for b in range(len(self.requests))]


@torch.inference_mode()
def generate(model, tokenizer, requests: list[Request], settings: GenerationSettings,
             observe: Observer | None = None, shared: SharedPrefill | None = None) -> list[Generation]:
    """Generate answers for a batch of requests under one policy and budget; with `shared`, from a
    prefill of the same requests shared with other cells (full prefill only)."""
    with evalkit_attention(model):
        run = start(model, tokenizer, requests, settings, observe, shared)
        begun = time.perf_counter()
        while (tokens := run.next_tokens()) is not None:
            logits, _ = forward(run.state, tokens)
            run.advance(logits)
    return run.generations(time.perf_counter() - begun)


def start(model, tokenizer, requests: list[Request], settings: GenerationSettings,
          observe: Observer | None = None, shared: SharedPrefill | None = None) -> Decoding:
    """Prefill (compressing as the policy says) and get ready to decode; call inside `evalkit_attention`."""
    policy = settings.policy
    compressed, appended = split_prompts(requests, settings.query_aware)
    if shared is not None and (settings.prefill != "full" or shared.compressed != compressed):
        raise ValueError("a shared prefill serves full-prefill runs of the same prompts only")
    lengths, budget, evicting, budgets = run_budgets(model, settings, compressed)
    extra = torch.tensor([len(t) for t in appended])
    max_new = torch.tensor([r.max_new_tokens for r in requests])
    begun = time.perf_counter()
    decode_evicts = bool(evicting.any()) and settings.decode_eviction
    decode_collect = policy.collect_decode if decode_evicts else None
    forks_compressed = shared is not None and not any(appended) and observe is None
    state = new_state(model, settings, lengths, budgets, extra + max_new, observe, with_cache=not forks_compressed)
    state.collect = policy.collect_prefill if bool(evicting.any()) else None
    if forks_compressed:  # the cell's cache receives only what compression keeps (`SharedPrefill.fork_compressed`)
        logits = shared.fork_compressed(state, budgets, extra + max_new)
    else:
        logits = prefill(state, compressed, appended, budgets, decode_collect, shared)
    prefill_seconds = time.perf_counter() - begun + (shared.seconds if shared is not None else 0.0)

    state.collect = decode_collect
    restrict_reads(state, budget, lengths, extra)
    return Decoding(state, requests, tokenizer, logits, budgets + extra, decode_evicts, lengths + extra,
                    prefill_seconds)


def run_budgets(model, settings: GenerationSettings, compressed: list[list[int]]):
    """(lengths [B], budget [B] in tokens, evicting [B] bool, per-layer caps [L, B]) for the compressed prompts."""
    policy = settings.policy
    lengths = torch.tensor([len(t) for t in compressed])
    budget = resolve_budget(settings.budget, lengths)
    evicting = (budget < lengths) & policy.evicts
    num_layers = model_kv_shape(model.config)[0]
    # A sequence at full budget is never evicted, not even while decoding.
    budgets = torch.where(evicting, torch.minimum(policy.layer_budgets(budget, lengths, num_layers), lengths), NO_LIMIT)
    if policy.granularity in PAGE_GRANULARITIES:  # a share below one page keeps one page (docs/policies.md)
        budgets = torch.maximum(budgets, torch.minimum(lengths, torch.tensor(settings.block_size)))
    return lengths, budget, evicting, budgets


def new_state(model, settings: GenerationSettings, lengths: torch.Tensor, budgets: torch.Tensor,
               after_prefill: torch.Tensor, observe: Observer | None, with_cache: bool = True) -> LoopState:
    """A state whose cache holds the prefill's peak plus `after_prefill` [B] more tokens per head (none yet
    without `with_cache`)."""
    widest = budgets.amax(0)
    prefill_peak = lengths if settings.prefill == "full" else torch.minimum(lengths, widest + settings.chunk_size)
    cache = new_cache(model, settings, prefill_peak, after_prefill) if with_cache else None
    start = torch.zeros(len(lengths), dtype=torch.long)
    return LoopState(model, cache, settings.policy, settings, start, start.clone(), observe)


def new_cache(model, settings: GenerationSettings, peak: torch.Tensor, after_prefill: torch.Tensor) -> KVCache:
    """A cache for `peak` [B] tokens per head during the prefill and `after_prefill` [B] more after it."""
    capacity = int((peak + after_prefill + 1).max())
    return KVCache.create(settings.layout, model.config, len(peak), capacity, settings.block_size,
                          model.dtype, model.device, settings.pool_pages)


def restrict_reads(state: LoopState, budget: torch.Tensor, lengths: torch.Tensor, extra: torch.Tensor) -> None:
    """Install the policy's decode-time read restriction (Quest), if it has one."""
    policy, settings = state.policy, state.settings
    if policy.restricts_reads:
        read_budget = torch.where(budget < lengths, budget + extra, NO_LIMIT)
        state.attend_filter = lambda layer, query, keys, positions: policy.attended_slots(
            layer, query, keys, positions, read_budget, settings.block_size)
    state.attended, state.available = torch.zeros(len(lengths)), torch.zeros(len(lengths))


def split_prompts(requests, query_aware: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(what prefill compresses, what it appends uncompressed): the question joins the first when query-aware."""
    if query_aware:
        return [r.context_ids + r.question_ids for r in requests], [[] for _ in requests]
    return [list(r.context_ids) for r in requests], [list(r.question_ids) for r in requests]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
