"""A naive oracle for evalkit's eviction: docs/policies.md, literally, in plain loops.

Written without evalkit's cache, attention, policy or selection code. One sequence at a
time (B = 1), greedy, with the model in float64:

- every forward recomputes the WHOLE token sequence with a plain softmax(QK^T)V attention
  (registered with transformers' AttentionInterface) under an explicit mask per
  (layer, query head): query q sees key j iff j <= q and key j (in that layer and KV head)
  had not been evicted before the forward in which q was fed (plus, for Quest, the pages
  q's decode step chose to read). Evictions are permanent, so recording, per
  (layer, KV head, position), the forward after which it was evicted is enough;
- statistics come from those probabilities (mean over the G query heads of a KV head),
  keys for key norm from the attention function's `key` argument (post-RoPE);
- budgets, protected tokens, scores and selection at the four granularities, the
  pyramid schedule, Ada-KV and Quest follow docs/policies.md, one rule per function;
  scores are compared at float32 precision, evalkit's (see `float32`).

`run_oracle` returns the generated tokens and, after every prefill chunk, after prefill and
after every decode step, the sorted kept positions of each (layer, KV head).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "evalkit_oracle"

# --- what each policy family is (docs/policies.md and the policies' published defaults) ---------

SNAPKV_FAMILY = ("snapkv", "pyramidkv", "adakv")
# Statistic collected by prompt forwards, and by the appended question and decoded tokens.
COLLECT = {
    "h2o": ("attention", "attention"),
    "tova": ("window", "window"),
    "snapkv": ("window", None),
    "pyramidkv": ("window", None),
    "adakv": ("window", None),
}
NEEDS_STATISTIC = tuple(COLLECT)  # their recent window widens by the tokens no statistic has seen
NEVER_EVICTS = ("full", "quest")
FAMILIES = ("full", "quest", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "knorm", "random", "streaming_llm")


@dataclass(frozen=True)
class Spec:
    """A policy for the oracle: family, granularity and hyper-parameters."""

    family: str
    granularity: str = "head"
    sinks: int = 0
    recent_tokens: int = 0
    recent_fraction: float = 0.0
    window: int = 0  # queries behind a "window" statistic
    kernel: int = 7  # SnapKV pooling
    pooling: str = "max"
    normalize: bool = False  # H2O: divide by the number of queries that could see the token
    beta: float = 20.0  # PyramidKV
    alpha: float = 0.2  # Ada-KV safeguard
    dense_layers: int = 2  # Quest: the first layers read everything
    min_pages: int = 3  # Quest: pages a decode query reads at least


def published_spec(family: str, granularity: str = "head", **overrides) -> Spec:
    """The published defaults: H2O half the budget recent; TOVA the last query, the newest token
    kept (kvpress pads its score with max + 1); SnapKV w=32, kernel 7, max pooling, its window
    protected on top of any recent tokens; StreamingLLM 4 sinks + recent rest; Quest two dense
    layers, at least 3 pages."""
    if family not in FAMILIES:
        raise KeyError(f"the oracle has no rule for policy family {family!r}: add it to tests/oracle.py")
    fields = {
        "h2o": dict(recent_fraction=0.5),
        "tova": dict(window=1, recent_tokens=1),
        "snapkv": dict(window=32, kernel=7, pooling="max"),
        "pyramidkv": dict(window=32, kernel=7, pooling="max", beta=20.0),
        "adakv": dict(window=32, kernel=7, pooling="max", alpha=0.2),
        "streaming_llm": dict(sinks=4, recent_fraction=1.0),
        "quest": dict(dense_layers=2, min_pages=3),
    }.get(family, {})
    fields.update(overrides)
    if family in SNAPKV_FAMILY:  # the observation window itself is protected, on top of recent_tokens
        fields["recent_tokens"] = fields.get("recent_tokens", 0) + fields["window"]
    return Spec(family, granularity, **fields)


@dataclass(frozen=True)
class Settings:
    budget: float
    block_size: int = 4
    prefill: str = "full"  # or "chunked"
    chunk_size: int = 16
    query_aware: bool = True
    decode_eviction: bool = True
    seed: int = 0


Kept = tuple  # [layer][kv head] -> tuple of sorted kept positions


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    chunks: list[Kept] = field(default_factory=list)  # after each prefill chunk (and its compression)
    prefill: Kept = ()  # after prefill (question appended when query-agnostic)
    steps: list[Kept] = field(default_factory=list)  # after each decode step (and its compression)
    budget: int = 0  # k
    layer_budgets: list[int] = field(default_factory=list)  # k_l (empty when not evicting)
    evicting: bool = False
    scores: dict = field(default_factory=dict)  # phase -> [layer][head] {position: score} at its last compression


# --- budgets ---------------------------------------------------------------------------------------


def budget_tokens(budget: float, n: int) -> int:
    """k: ceil(f·n) (f·n rounded to 9 decimals first) for a fraction, min(k, n) for an integer; >= 1."""
    if budget <= 1:
        k = math.ceil(round(budget * n, 9))
    else:
        k = int(budget)
    return max(1, min(k, n))


def pyramid_budgets(k: int, n: int, num_layers: int, window: int, beta: float) -> list[int]:
    """KVCache-Factory's schedule: a linear pyramid of selected tokens, the window on top."""
    m = k - window
    if m <= 0:
        return [k] * num_layers  # budget not above the window: SnapKV
    lo = int(m // beta)
    hi = 2 * m - lo
    if hi > n - window:
        hi = n - window
        lo = 2 * m - hi
    if num_layers == 1:
        return [m + window]
    exact = [Fraction(hi) - Fraction((hi - lo) * layer, num_layers - 1) for layer in range(num_layers)]
    selected = [math.floor(x) for x in exact]
    missing = num_layers * m - sum(selected)
    by_remainder = sorted(range(num_layers), key=lambda layer: (-(exact[layer] - selected[layer]), layer))
    for layer in by_remainder[:missing]:
        selected[layer] += 1
    return [s + window for s in selected]


def layer_budgets(spec: Spec, k: int, n: int, num_layers: int, block_size: int) -> list[int]:
    """k_l: uniform k or the pyramid; at a page granularity a share below one page keeps one page."""
    if spec.family == "pyramidkv":
        caps = pyramid_budgets(k, n, num_layers, spec.window, spec.beta)
    else:
        caps = [k] * num_layers
    if spec.granularity in ("page", "head_page"):
        caps = [max(cap, min(n, block_size)) for cap in caps]
    return caps


def float32(x: float) -> float:
    """Every score the oracle compares is rounded to float32, the precision of evalkit's statistics,
    so that values equal at that precision tie (and go to the earlier position) as they do there."""
    return float(torch.tensor(x, dtype=torch.float32))


# --- keep orders -------------------------------------------------------------------------------


def keep_order(positions, score: dict, protected, sinks: int) -> list[int]:
    """Sinks (ascending), other protected (most recent first), the rest by score (highest first,
    ties to the earlier position)."""
    sink_part = sorted(p for p in positions if p < sinks)
    protected_part = sorted((p for p in positions if protected(p) and p >= sinks), reverse=True)
    rest = sorted((p for p in positions if not protected(p)), key=lambda p: (-score[p], p))
    return sink_part + protected_part + rest


def take_pages(pages: dict, cap: int, protected, sinks: int, seen: int, block_size: int) -> set[int]:
    """pages: {page: (positions held, mean score)}. Greedy fill in page order; returns pages taken."""

    def holds_sink(page):
        return any(p < sinks for p in pages[page][0])

    def is_protected(page):
        held = pages[page][0]
        being_filled = (seen - 1) in held and seen % block_size != 0
        return being_filled or any(protected(p) for p in held)

    order = (sorted(pg for pg in pages if holds_sink(pg))
             + sorted((pg for pg in pages if is_protected(pg) and not holds_sink(pg)), reverse=True)
             + sorted((pg for pg in pages if not is_protected(pg)), key=lambda pg: (-pages[pg][1], pg)))
    taken, total = set(), 0
    for page in order:
        count = len(pages[page][0])
        if total + count <= cap:
            taken.add(page)
            total += count
    return taken


# --- one sequence ------------------------------------------------------------------------------


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      oracle_sequence=None, **kwargs):
    return oracle_sequence.attend(module.layer_idx, query, key, value, scaling)


def _no_mask(*args, **kwargs):
    return None


@contextlib.contextmanager
def oracle_attention(model):
    AttentionInterface.register(ATTENTION_NAME, _oracle_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class Sequence:
    def __init__(self, model, spec: Spec, settings: Settings):
        config = model.config
        self.model, self.spec, self.settings = model, spec, settings
        self.L = config.num_hidden_layers
        self.H = config.num_key_value_heads
        self.G = config.num_attention_heads // self.H
        self.ids: list[int] = []
        self.fed_in: list[int] = []  # position -> index of the forward that fed it
        self.forwards = 0
        # (layer, head) -> {position: index of the forward after which it was evicted}
        self.evicted = {(l, h): {} for l in range(self.L) for h in range(self.H)}
        self.stat = {(l, h): [] for l in range(self.L) for h in range(self.H)}  # indexed by position
        self.stat_end = 0
        self.reads: dict = {}  # Quest: (layer, head, query position) -> set of positions it may read
        self.quest_pages = None  # Quest: pages a decode query reads (set while decoding)
        self.probs: dict = {}  # layer -> [H_q, T, T] probabilities of the last forward
        self.keys: dict = {}  # layer -> [H_kv, T, D] post-RoPE keys of the last forward

    @property
    def seen(self) -> int:
        return len(self.ids)

    def held(self, l: int, h: int) -> list[int]:
        return [p for p in range(self.seen) if p not in self.evicted[l, h]]

    def kept(self) -> Kept:
        return tuple(tuple(tuple(self.held(l, h)) for h in range(self.H)) for l in range(self.L))

    # -- attention --

    def visible(self, l: int, h: int) -> torch.Tensor:
        """[T, T] bool: query q sees key j."""
        T = self.seen
        q = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        fed_in = torch.tensor(self.fed_in)[:, None]
        evicted_after = torch.tensor([self.evicted[l, h].get(p, math.inf) for p in range(T)])[None, :]
        allowed = (j <= q) & (evicted_after >= fed_in)
        for (layer, head, pos), read in self.reads.items():
            if layer == l and head == h:
                allowed[pos] &= torch.tensor([p in read for p in range(T)])
        return allowed

    def attend(self, l, query, key, value, scaling):
        T = query.shape[2]
        assert T == self.seen and query.shape[0] == 1
        self.keys[l] = key[0]
        if self.quest_pages is not None and l >= self.spec.dense_layers:  # the first layers read everything
            self.choose_quest_reads(l, query[0, :, T - 1], key[0])
        per_head = [self.visible(l, h) for h in range(self.H)]
        allowed = torch.stack([per_head[qh // self.G] for qh in range(self.H * self.G)])  # [H_q, T, T]
        k = key[0].repeat_interleave(self.G, dim=0)  # [H_q, T, D]: query head qh uses KV head qh // G
        v = value[0].repeat_interleave(self.G, dim=0)
        scores = (query[0] @ k.transpose(1, 2)) * scaling
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        self.probs[l] = probs
        return (probs @ v).transpose(0, 1)[None], None  # [1, T, H_q, D]

    def choose_quest_reads(self, l, query, keys):
        """The pages the newest query reads: the newest page, then the best bounds (ties: earlier page)."""
        q_pos, S = self.seen - 1, self.settings.block_size
        bound = {}
        for h in range(self.H):
            held = [p for p in self.held(l, h) if p <= q_pos]
            for page in sorted({p // S for p in held}):
                page_keys = keys[h, [p for p in held if p // S == page]]  # [n, D]
                lo, hi = page_keys.min(0).values, page_keys.max(0).values
                for g in range(self.G):
                    qg = query[h * self.G + g]
                    bound[h, page] = bound.get((h, page), 0.0) + float(torch.maximum(qg * lo, qg * hi).sum())
        for h in range(self.H):
            held = [p for p in self.held(l, h) if p <= q_pos]
            pages = sorted({p // S for p in held})
            if self.spec.granularity == "token":  # one choice for all heads: summed over every query head
                rank = {page: sum(bound[hh, page] for hh in range(self.H)) for page in pages}
            else:
                rank = {page: bound[h, page] for page in pages}
            newest = q_pos // S
            order = [newest] + sorted((pg for pg in pages if pg != newest), key=lambda pg: (-rank[pg], pg))
            chosen = set(order[:self.quest_pages])
            self.reads[l, h, q_pos] = {p for p in held if p // S in chosen}

    # -- forwards and statistics --

    def forward(self, tokens: list[int], collect: str | None) -> torch.Tensor:
        """Feed `tokens`, recomputing the whole sequence; returns the last position's logits."""
        first = self.seen
        self.ids += tokens
        self.fed_in += [self.forwards] * len(tokens)
        for key in self.stat:
            self.stat[key] += [0.0] * len(tokens)
        ids = torch.tensor([self.ids])
        with torch.no_grad():
            logits = self.model(input_ids=ids, position_ids=torch.arange(self.seen)[None], use_cache=False,
                                oracle_sequence=self).logits[0, -1]
        new_queries = list(range(first, self.seen))
        if collect is not None:
            self.collect(collect, new_queries)
        self.forwards += 1
        return logits

    def collect(self, kind: str, new_queries: list[int]) -> None:
        if kind == "window":  # the last w queries of the forward (fewer if it has fewer) replace
            counted = new_queries[-self.spec.window:]
        else:  # "attention": every new query adds
            counted = new_queries
        for l in range(self.L):
            for h in range(self.H):
                group = self.probs[l][h * self.G:(h + 1) * self.G]  # [G, T, T]
                per_key = group.mean(0)[counted].sum(0)  # mean over the group, summed over counted queries
                for p in self.held(l, h):
                    if kind == "window":
                        self.stat[l, h][p] = float(per_key[p])
                    else:
                        self.stat[l, h][p] += float(per_key[p])
        self.stat_end = self.seen

    # -- scores --

    def scores(self, l: int, h: int) -> dict:
        """{held position: score}, higher = keep; rounded to float32 (see `float32`)."""
        return {p: float32(x) for p, x in self.exact_scores(l, h).items()}

    def exact_scores(self, l: int, h: int) -> dict:
        family, held = self.spec.family, self.held(l, h)
        if family == "h2o":
            stat = self.stat[l, h]
            if self.spec.normalize:
                return {p: stat[p] / (self.stat_end - p) if p < self.stat_end else stat[p] for p in held}
            return {p: stat[p] for p in held}
        if family == "tova":
            return {p: self.stat[l, h][p] for p in held}
        if family in SNAPKV_FAMILY:
            return self.pooled(l, h)
        if family == "knorm":
            return {p: -float(self.keys[l][h, p].norm()) for p in held}
        if family == "random":
            generator = torch.Generator().manual_seed(self.settings.seed * 100_003 + l)
            priority = torch.rand(self.seen, self.H, generator=generator)
            return {p: float(priority[p, h]) for p in held}
        return {p: 0.0 for p in held}  # StreamingLLM, full, Quest: position only

    def pooled(self, l: int, h: int) -> dict:
        """SnapKV: the window statistic of the prefix (positions < stat_end - w), pooled along positions
        (width `kernel`, stride 1, padding kernel // 2); zeros outside the prefix and for evicted tokens;
        avg counts the padding. A position outside the prefix scores 0 (it is protected anyway)."""
        held = self.held(l, h)
        prefix_end = self.stat_end - self.spec.window
        radius = self.spec.kernel // 2

        def signal(j):
            return self.stat[l, h][j] if (0 <= j < prefix_end and j in held) else 0.0

        out = {}
        for p in held:
            around = [signal(j) for j in range(p - radius, p + radius + 1)]
            pooled = max(around) if self.spec.pooling == "max" else sum(around) / self.spec.kernel
            out[p] = pooled if p < prefix_end else 0.0
        return out

    # -- compression --

    def compress(self, caps: list[int]) -> dict:
        """Evict each layer down to caps[l] per head; returns the scores used, for messages."""
        used = {}
        for l, cap in enumerate(caps):
            held = [self.held(l, h) for h in range(self.H)]
            if all(len(x) <= cap for x in held):
                continue  # layers whose heads all hold <= their cap are left alone
            scores = [self.scores(l, h) for h in range(self.H)]
            used[l] = scores
            keep = self.select(l, cap, held, scores)
            for h in range(self.H):
                for p in held[h]:
                    if p not in keep[h]:
                        self.evicted[l, h][p] = self.forwards - 1
        return used

    def recent(self, cap: int) -> int:
        spec = self.spec
        widen = self.seen - self.stat_end if spec.family in NEEDS_STATISTIC else 0
        return min(cap, spec.recent_tokens + math.floor(spec.recent_fraction * max(cap - spec.sinks, 0)) + widen)

    def select(self, l: int, cap: int, held: list[list[int]], scores: list[dict]) -> list[set[int]]:
        spec, seen, S = self.spec, self.seen, self.settings.block_size
        recent = self.recent(cap)

        def protected(p):
            return p < spec.sinks or p >= seen - recent

        if spec.family == "adakv" and spec.granularity == "head":
            return self.select_adakv(cap, held, scores, protected)
        if spec.granularity == "head":
            return [set(keep_order(held[h], scores[h], protected, spec.sinks)[:cap]) for h in range(self.H)]
        if spec.granularity == "token":
            tokens = sorted(set().union(*held))
            score = {}
            for p in tokens:
                holders = [h for h in range(self.H) if p in held[h]]
                score[p] = float32(sum(scores[h][p] for h in holders) / len(holders))
            kept = set(keep_order(tokens, score, protected, spec.sinks)[:cap])
            return [set(held[h]) & kept for h in range(self.H)]
        if spec.granularity == "page":
            pages = {}
            for page in sorted({p // S for x in held for p in x}):
                pairs = [(h, p) for h in range(self.H) for p in held[h] if p // S == page]
                positions = sorted({p for _, p in pairs})
                pages[page] = (positions, float32(sum(scores[h][p] for h, p in pairs) / len(pairs)))
            taken = take_pages(pages, cap, protected, spec.sinks, seen, S)
            return [{p for p in held[h] if p // S in taken} for h in range(self.H)]
        if spec.granularity == "head_page":
            keep = []
            for h in range(self.H):
                pages = {}
                for page in sorted({p // S for p in held[h]}):
                    positions = [p for p in held[h] if p // S == page]
                    pages[page] = (positions, float32(sum(scores[h][p] for p in positions) / len(positions)))
                taken = take_pages(pages, cap, protected, spec.sinks, seen, S)
                keep.append({p for p in held[h] if p // S in taken})
            return keep
        raise ValueError(spec.granularity)

    def select_adakv(self, cap, held, scores, protected) -> list[set[int]]:
        """A layer keeps cap·H_kv: each head its protected tokens (at most cap) and its best
        ceil(alpha·cap), in its keep order; the rest to the highest remaining scores of any head
        (ties: lower head, earlier position)."""
        floor = math.ceil(round(self.spec.alpha * cap, 9))
        keep = []
        for h in range(self.H):
            order = keep_order(held[h], scores[h], protected, self.spec.sinks)
            n_protected = min(sum(1 for p in held[h] if protected(p)), cap)
            keep.append(set(order[:max(n_protected, floor)]))
        left = cap * self.H - sum(len(x) for x in keep)
        remaining = sorted(((h, p) for h in range(self.H) for p in held[h] if p not in keep[h]),
                           key=lambda hp: (-scores[hp[0]][hp[1]], hp[0], hp[1]))
        for h, p in remaining[:max(left, 0)]:
            keep[h].add(p)
        return keep


# --- the whole run -----------------------------------------------------------------------------


def run_oracle(model, spec: Spec, settings: Settings, context: list[int], question: list[int],
               max_new_tokens: int) -> Trace:
    """One request, as docs/policies.md says evalkit's loop must process it. `model` in float64."""
    seq = Sequence(model, spec, settings)
    compressed = context + question if settings.query_aware else list(context)
    appended = [] if settings.query_aware else list(question)
    n = len(compressed)
    trace = Trace(budget=budget_tokens(settings.budget, n))
    k = trace.budget
    trace.evicting = k < n and spec.family not in NEVER_EVICTS
    caps = layer_budgets(spec, k, n, seq.L, settings.block_size) if trace.evicting else None
    trace.layer_budgets = list(caps or [])
    collect_prefill, collect_decode = COLLECT.get(spec.family, (None, None))
    decode_evicts = trace.evicting and settings.decode_eviction

    with oracle_attention(model):
        chunk = settings.chunk_size if settings.prefill == "chunked" else n
        for index, start in enumerate(range(0, n, chunk)):
            logits = seq.forward(compressed[start:start + chunk], collect_prefill if trace.evicting else None)
            if trace.evicting:
                trace.scores[f"prefill chunk {index}"] = seq.compress(caps)
            trace.chunks.append(seq.kept())
        if appended:  # the question, never compressed; collects the decode statistic
            logits = seq.forward(appended, collect_decode if decode_evicts else None)
        trace.prefill = seq.kept()

        q = len(appended)
        if spec.family == "quest" and k < n:  # nothing evicted; decode queries read the best pages
            seq.quest_pages = max(spec.min_pages, math.ceil((k + q) / settings.block_size))
        for step in range(max_new_tokens):
            token = int(logits.argmax())
            trace.tokens.append(token)
            if step == max_new_tokens - 1:
                break
            logits = seq.forward([token], collect_decode if decode_evicts else None)
            if decode_evicts:
                trace.scores[f"decode step {step}"] = seq.compress([c + q for c in caps])
            trace.steps.append(seq.kept())
    return trace
