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
  keys and values from the attention function's `key` and `value` arguments (post-RoPE keys),
  the queries before RoPE from each layer's `q_proj` (Expected Attention), the future RoPE
  from the model's own rotary embedding, the output projection from each layer's `o_proj`;
- a sliding-window layer (Gemma 3's, window W from the model's config) lets query q see key j only when
  q - W < j, and after every forward (each prefill chunk, the appended question, each decode step), for every
  policy, evicts the positions p <= seen - W that no later query can see; its cap is then min(k_l, W - 1)
  (`sliding_layers` "budget") or W - 1 whatever the budget ("window");
- DuoAttention's head scores are its input (evalkit's, computed once per model by the test: the calibration
  itself is held to kvpress's computation in tests/test_duo_attention.py); how many heads stream, which, and
  what each keeps are derived here;
- KVzip's context reconstruction is one more forward over the sequence with the reconstruction
  tokens appended (seeing what is held), whose tokens are then dropped again; its words, asked in a
  tokenizer's ids when the run has one, are built from the tokenizer's chat template as kvpress builds them;
- budgets, protected tokens, scores and selection at the four granularities, the
  pyramid schedule, Ada-KV (over any scorer), CriticalKV's two stages, KVzip's budget pooled
  over layers and Quest follow docs/policies.md and the policies' definitions (kvpress 0.5.5's
  presses), one rule per function; scores are compared at float32 precision, evalkit's (see
  `float32`).

`run_oracle` returns the generated tokens and, after every prefill chunk, after prefill and
after every decode step, the sorted kept positions of each (layer, KV head). Given later turns it runs a
conversation on the same cache (docs/tasks.md, "Several questions on one context"): after each answer, one forward
feeds the answer's unfed last token (none when it ended on an end-of-sequence token, which is never fed) and the
next turn's prompt, as the question appended after compression is fed, the cache is evicted back to the decode caps,
and the turn's answer is decoded as the first was; the kept positions are recorded after every forward.
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

# Scorers the wrappers take: `adakv_<scorer>` (Ada-KV's allocation) and `critical_<scorer>` (CriticalKV's stages).
WRAPPED = ("h2o", "snapkv", "tova", "knorm", "keydiff", "lagkv", "expected_attention")
WRAPPERS = ("adakv", "critical")
# Statistic collected by prompt forwards, and by the appended question and decoded tokens (per scorer).
COLLECT = {
    "h2o": ("attention", "attention"),
    "tova": ("window", "window"),
    "snapkv": ("window", None),
}
# Their recent window widens by the tokens no statistic has seen (KVzip's: the reconstruction's).
NEEDS_STATISTIC = (*COLLECT, "kvzip")
NEVER_EVICTS = ("full", "quest")
FAMILIES = ("full", "quest", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "knorm", "random", "streaming_llm",
            "keydiff", "lagkv", "expected_attention", "kvzip", "duo_attention",
            *(f"{w}_{s}" for w in WRAPPERS for s in WRAPPED))
FIRST_STAGE = 2.0 ** 100  # CriticalKV: a first-stage pick's score, above any other and finite in page means
RECONSTRUCTION_TAIL = 8  # KVzip: a later chunk's reconstruction starts from the previous chunk's last 8 tokens
# KVzip: what the first chunk's reconstruction asks, and what every later one asks (kvpress's KVzipPress.prepare)
RECONSTRUCT_FIRST = "\n\nRepeat the previous context exactly."
RECONSTRUCT_LATER = "\n\nRepeat the part of the previous context exactly, starting with"


def scorer_of(family: str) -> str:
    """The scoring rule of a family: PyramidKV and `adakv` score as SnapKV, a wrapper as what it wraps."""
    if family in ("pyramidkv", "adakv"):
        return "snapkv"
    for wrapper in WRAPPERS:
        if family.startswith(wrapper + "_"):
            return family[len(wrapper) + 1:]
    return family


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
    lag_size: int = 128  # LagKV: partition length
    n_future: int = 512  # Expected Attention: future positions RoPE is averaged over
    use_covariance: bool = True  # Expected Attention: the queries' covariance term
    use_vnorm: bool = True  # Expected Attention: times the value's L2 norm (after + epsilon)
    epsilon: float = 0.0  # Expected Attention
    critical_epsilon: float = 1e-4  # CriticalKV: (score + epsilon) x projected value norm
    first_stage_ratio: float = 0.5  # CriticalKV: share of the budget picked by the scorer alone
    recon_chunk: int = 2048  # KVzip: context tokens per reconstruction forward
    layerwise: bool = False  # KVzip: each layer its own budget (else one budget over layers and heads)
    pool_pages: bool = False  # KVzip at head_page: one budget over the pages of every layer and head
    # DuoAttention: the model's head scores [layer][KV head] (its input, not re-derived: the calibration is held to
    # kvpress's computation in tests/test_duo_attention.py); `sinks` and `recent_tokens` are its sink_size and
    # recent_size
    head_scores: tuple = ()
    head_compression_ratio: float = 0.0  # DuoAttention: > 0 streams round(heads x ratio) heads, whatever the budget

    @property
    def scorer(self) -> str:
        return scorer_of(self.family)

    @property
    def adaptive(self) -> bool:  # Ada-KV's allocation across the heads of a layer
        return self.family == "adakv" or self.family.startswith("adakv_")

    @property
    def critical(self) -> bool:
        return self.family.startswith("critical_")


def published_spec(family: str, granularity: str = "head", **overrides) -> Spec:
    """The published defaults: H2O half the budget recent; TOVA the last query, the newest token
    kept (kvpress pads its score with max + 1); SnapKV w=32, kernel 7, max pooling, its window
    protected on top of any recent tokens; StreamingLLM 4 sinks + recent rest; Quest two dense
    layers, at least 3 pages; kvpress 0.5.5's LagKV (4 sinks, lag 128), Expected Attention (4 sinks,
    512 future positions, covariance and value norm, epsilon 0) and KVzip (4 sinks, chunks of 2048,
    pooled over layers); DuoAttention's streaming heads 128 sinks + 256 recent; KeyDiff none. Ada-KV adds a
    safeguard of 0.2, CriticalKV epsilon 1e-4 and a first stage of half the budget, with Expected Attention's value
    norm off (kvpress's advice)."""
    if family not in FAMILIES:
        raise KeyError(f"the oracle has no rule for policy family {family!r}: add it to tests/oracle.py")
    scorer = scorer_of(family)
    fields = {
        "h2o": dict(recent_fraction=0.5),
        "tova": dict(window=1, recent_tokens=1),
        "snapkv": dict(window=32, kernel=7, pooling="max"),
        "streaming_llm": dict(sinks=4, recent_fraction=1.0),
        "quest": dict(dense_layers=2, min_pages=3),
        "lagkv": dict(sinks=4, lag_size=128),
        "expected_attention": dict(sinks=4, n_future=512, use_covariance=True, use_vnorm=True, epsilon=0.0),
        "kvzip": dict(sinks=4, recon_chunk=2048, layerwise=False),
        "duo_attention": dict(sinks=128, recent_tokens=256),
    }.get(scorer, {})
    if family == "pyramidkv":
        fields["beta"] = 20.0
    if family == "adakv" or family.startswith("adakv_"):
        fields["alpha"] = 0.2
    if family.startswith("critical_"):
        fields.update(critical_epsilon=1e-4, first_stage_ratio=0.5)
        if scorer == "expected_attention":
            fields["use_vnorm"] = False
    fields.update(overrides)
    if scorer == "snapkv":  # the observation window itself is protected, on top of recent_tokens
        fields["recent_tokens"] = fields.get("recent_tokens", 0) + fields["window"]
    return Spec(family, granularity, **fields)


@dataclass(frozen=True)
class Settings:
    budget: float
    page_size: int = 4
    prefill: str = "full"  # or "chunked"
    chunk_size: int = 16
    query_aware: bool = True
    decode_eviction: bool = True
    seed: int = 0
    sliding_layers: str = "budget"  # a sliding layer's cap: min(k_l, W - 1), or "window": W - 1 whatever k_l


Kept = tuple  # [layer][kv head] -> tuple of sorted kept positions


@dataclass
class Turn:
    """A later turn of a conversation (`run_oracle`'s `later_turns`)."""

    fed: list[int] = field(default_factory=list)  # its one forward: the previous answer's unfed token, its prompt
    after_fed: Kept = ()  # after that forward (and its compression)
    tokens: list[int] = field(default_factory=list)  # its answer
    steps: list[Kept] = field(default_factory=list)  # after each decode step (and its compression)


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
    turns: list[Turn] = field(default_factory=list)  # a conversation's later turns (the first is the fields above)


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


def layer_budgets(spec: Spec, k: int, n: int, num_layers: int, page_size: int) -> list[int]:
    """k_l: uniform k or the pyramid; at a page granularity a share below one page keeps one page."""
    if spec.family == "pyramidkv":
        caps = pyramid_budgets(k, n, num_layers, spec.window, spec.beta)
    else:
        caps = [k] * num_layers
    if spec.granularity in ("page", "head_page"):
        caps = [max(cap, min(n, page_size)) for cap in caps]
    return caps


def float32(x: float) -> float:
    """Every score the oracle compares is rounded to float32, the precision of evalkit's statistics,
    so that values equal at that precision tie (and go to the earlier position) as they do there.
    A score that is an exact rational by definition (LagKV's rank / lag) stays exact (`Fraction`): equal ones,
    and equal means of them, tie, whatever float32 would make of them."""
    return x if isinstance(x, Fraction) else float(torch.tensor(x, dtype=torch.float32))


def mean_score(values: list):
    """The mean of a unit's scores (a token's over heads, a page's over its pairs), each already at the precision of
    `float32`: summed exactly (float64, or exactly for fractions), then at that precision again."""
    return float32(sum(values) / len(values))


def duo_streaming_count(k: int, n: int, w: int, heads: int, ratio: float = 0.0) -> int:
    """DuoAttention: s = min(H, ceil(H (n - k) / (n - w))) heads stream, none when n <= w (exact integers); with a
    head compression ratio, round(H x ratio) (kvpress's n_pruned, Python's round) whatever k."""
    if n <= w:
        return 0
    if ratio > 0:
        return round(heads * ratio)
    s = -(-(heads * (n - k)) // (n - w))  # ceil, exactly
    return max(0, min(heads, s))


def duo_caps(streaming: set, n: int, num_layers: int, spec: Spec, page_size: int) -> list[int]:
    """DuoAttention's layer caps: w = sinks + recent (at most n) in a layer with a streaming head, n elsewhere; at
    head_page a cap below one page is one page (as for every policy)."""
    caps = [min(n, spec.sinks + spec.recent_tokens) if any(l == x for x, _ in streaming) else n
            for l in range(num_layers)]
    if spec.granularity == "head_page":
        caps = [max(cap, min(n, page_size)) for cap in caps]
    return caps


def duo_streaming(head_scores, k: int, n: int, w: int, ratio: float = 0.0) -> set:
    """The s lowest-scoring (layer, KV head) pairs of the whole model (ties: lower layer, then lower head)."""
    pairs = [(float(score), l, h) for l, row in enumerate(head_scores) for h, score in enumerate(row)]
    assert pairs, "DuoAttention needs the model's head scores (Spec.head_scores)"
    s = duo_streaming_count(k, n, w, len(pairs), ratio)
    chosen = []
    for _ in range(s):  # plain selection: the lowest remaining, the first of equals in (layer, head) order
        best = None
        for score, l, h in pairs:
            if (l, h) in chosen:
                continue
            if best is None or score < best[0]:
                best = (score, l, h)
        chosen.append(best[1:])
    return set(chosen)


@dataclass(frozen=True)
class KVzipPrompts:
    """KVzip's reconstruction prompts in a tokenizer's ids: the prompt's first `prefix` positions (the chat
    template's text before the user's) are never reconstructed; a chunk's tokens are fed after `first` (the first
    chunk) or `later` and the previous chunk's tail, then `suffix` (the template's assistant turn)."""

    prefix: int = 0
    first: tuple = ()
    later: tuple = ()
    suffix: tuple = ()


def kvzip_prompts(tokenizer) -> KVzipPrompts:
    """As kvpress's KVzipPress.__call__ builds them: the chat template applied to one user turn, "dummy context"
    and a separator ("\n" and as many "#"), with the generation prompt; its text before "dummy context" is the
    prefix, after the separator the suffix ("\n" without a template). No tokenizer (the loop's token-level API):
    no words, nothing before the user's text."""
    if tokenizer is None:
        return KVzipPrompts()
    prefix, suffix = "", "\n"
    if tokenizer.chat_template is not None:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix = text.split(separator)
        prefix = context.split(dummy)[0]

    def ids(text: str) -> tuple:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return KVzipPrompts(len(ids(prefix)), ids(RECONSTRUCT_FIRST), ids(RECONSTRUCT_LATER), ids(suffix))


# --- keep orders -------------------------------------------------------------------------------


def keep_order(positions, score: dict, protected, sinks: int) -> list[int]:
    """Sinks (ascending), other protected (most recent first), the rest by score (highest first,
    ties to the earlier position)."""
    sink_part = sorted(p for p in positions if p < sinks)
    protected_part = sorted((p for p in positions if protected(p) and p >= sinks), reverse=True)
    rest = sorted((p for p in positions if not protected(p)), key=lambda p: (-score[p], p))
    return sink_part + protected_part + rest


def take_pages(pages: dict, cap: int, protected, sinks: int, seen: int, page_size: int) -> set[int]:
    """pages: {page: (positions held, mean score)}. Greedy fill in page order; returns pages taken."""

    def holds_sink(page):
        return any(p < sinks for p in pages[page][0])

    def is_protected(page):
        held = pages[page][0]
        being_filled = (seen - 1) in held and seen % page_size != 0
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
                      oracle_sequence=None, sliding_window=None, **kwargs):
    # The window the model masks this layer with is the one the oracle read from the config.
    assert sliding_window == oracle_sequence.windows[module.layer_idx], (module.layer_idx, sliding_window)
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
    def __init__(self, model, spec: Spec, settings: Settings, prompts: KVzipPrompts = KVzipPrompts()):
        config = model.config
        self.model, self.spec, self.settings, self.prompts = model, spec, settings, prompts
        self.L = config.num_hidden_layers
        self.H = config.num_key_value_heads
        self.G = config.num_attention_heads // self.H
        self.D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Per layer its sliding window, or None: the layers `layer_types` calls "sliding_attention" (every layer when
        # there are no layer types) slide over `sliding_window` positions, if it is set.
        window = getattr(config, "sliding_window", None)
        kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * self.L
        self.windows = [window if kind == "sliding_attention" and window else None for kind in kinds]
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
        self.values: dict = {}  # layer -> [H_kv, T, D] values of the last forward
        self.queries: dict = {}  # layer -> ([H_q, T, D] post-RoPE queries, scaling) of the last forward
        self.prerope: dict = {}  # layer -> [T, H_q, D] queries before RoPE (q_proj's output), Expected Attention
        self.moments_end = 0  # Expected Attention: the compressed prompt's tokens fed so far
        self.streaming: set = set()  # DuoAttention: the (layer, KV head) pairs that stream
        self.appended = 0  # tokens appended uncompressed after the prompt (DuoAttention's window widens by them)

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
        if self.windows[l] is not None:
            allowed &= j > q - self.windows[l]
        for (layer, head, pos), read in self.reads.items():
            if layer == l and head == h:
                allowed[pos] &= torch.tensor([p in read for p in range(T)])
        return allowed

    def attend(self, l, query, key, value, scaling):
        T = query.shape[2]
        assert T == self.seen and query.shape[0] == 1
        self.keys[l], self.values[l], self.queries[l] = key[0], value[0], (query[0], scaling)
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
        q_pos, S = self.seen - 1, self.settings.page_size
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
        hooks = []
        if self.spec.scorer == "expected_attention":  # the queries before RoPE: q_proj's output
            for l, layer in enumerate(self.model.model.layers):
                assert not hasattr(layer.self_attn, "q_norm"), "a model with q_norm: its query before RoPE is after it"
                hooks.append(layer.self_attn.q_proj.register_forward_hook(
                    lambda module, args, out, l=l: self.prerope.__setitem__(l, out[0].view(out.shape[1], -1, self.D))))
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids, position_ids=torch.arange(self.seen)[None], use_cache=False,
                                    oracle_sequence=self).logits[0, -1]
        finally:
            for hook in hooks:
                hook.remove()
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

    def scores(self, l: int, h: int, cap: int) -> dict:
        """{held position: score}, higher = keep; rounded to float32 (see `float32`). `cap`: the layer's
        budget (CriticalKV's first stage is a share of it)."""
        scores = {p: float32(x) for p, x in self.exact_scores(l, h).items()}
        return self.critical(l, h, cap, scores) if self.spec.critical else scores

    def exact_scores(self, l: int, h: int) -> dict:
        scorer, held = self.spec.scorer, self.held(l, h)
        if scorer == "h2o":
            stat = self.stat[l, h]
            if self.spec.normalize:
                return {p: stat[p] / (self.stat_end - p) if p < self.stat_end else stat[p] for p in held}
            return {p: stat[p] for p in held}
        if scorer in ("tova", "kvzip"):  # the last query's attention; the reconstruction's max attention
            return {p: self.stat[l, h][p] for p in held}
        if scorer == "snapkv":
            return self.pooled(l, h)
        if scorer == "knorm":
            return {p: -float(self.keys[l][h, p].norm()) for p in held}
        if scorer == "keydiff":
            return self.keydiff(l, h)
        if scorer == "lagkv":
            return self.lagkv(l, h)
        if scorer == "expected_attention":
            return self.expected_attention(l, h)
        family = self.spec.family
        if family == "random":
            generator = torch.Generator().manual_seed(self.settings.seed * 100_003 + l)
            priority = torch.rand(self.seen, self.H, generator=generator)
            return {p: float(priority[p, h]) for p in held}
        return {p: 0.0 for p in held}  # StreamingLLM, full, Quest: position only

    def pooled(self, l: int, h: int) -> dict:
        """SnapKV: the window statistic of the prefix (positions < stat_end - w), pooled along positions
        (width `kernel`, stride 1, padding kernel // 2); zeros outside the prefix and for evicted tokens;
        avg counts the padding; divided by w (a mean over the window's queries, as kvpress's: the scale
        CriticalKV's epsilon meets). A position outside the prefix scores 0 (it is protected anyway)."""
        held = self.held(l, h)
        prefix_end = self.stat_end - self.spec.window
        radius = self.spec.kernel // 2

        def signal(j):
            return self.stat[l, h][j] if (0 <= j < prefix_end and j in held) else 0.0

        out = {}
        for p in held:
            around = [signal(j) for j in range(p - radius, p + radius + 1)]
            pooled = max(around) if self.spec.pooling == "max" else sum(around) / self.spec.kernel
            out[p] = pooled / self.spec.window if p < prefix_end else 0.0
        return out

    def keydiff(self, l: int, h: int) -> dict:
        """KeyDiff: minus the cosine of each held key with the mean of the head's held keys, each made unit length."""
        held = self.held(l, h)
        keys = {p: self.keys[l][h, p] for p in held}
        anchor = sum(k / k.norm() for k in keys.values()) / len(held)
        return {p: -float(k @ anchor / (k.norm() * anchor.norm())) for p, k in keys.items()}

    def lagkv(self, l: int, h: int) -> dict:
        """LagKV: the head's held tokens in position order; the first `sinks` of them score 1. With fewer than
        sinks + 2 lag tokens the others score by recency, (i - sinks) / (n - sinks). Otherwise the tokens after
        the sinks form partitions of `lag` (a remainder after the last whole one); each partition but the last
        is judged against the next: every channel of its keys (values) min-max normalised by the next
        partition's range, the standard deviation over channels (n - 1), a softmax over the partition; the
        mean of the keys' and values' is ranked within the partition (0 = lowest) and divided by lag. The last
        whole partition and the remainder score 1. The scores are exact fractions (see `float32`)."""
        held, sinks, lag = self.held(l, h), self.spec.sinks, self.spec.lag_size
        n = len(held)
        score = {p: Fraction(1) for p in held}
        if n < sinks + 2 * lag:
            for i in range(sinks, n):
                score[held[i]] = Fraction(i - sinks, n - sinks)
            return score
        partitions = (n - sinks) // lag
        parts = [held[sinks + j * lag: sinks + (j + 1) * lag] for j in range(partitions)]

        def spread(rows, part, reference):  # softmax over the partition of the normalised rows' spread
            low = [min(rows[r][c] for r in reference) for c in range(len(rows[part[0]]))]
            high = [max(rows[r][c] for r in reference) for c in range(len(rows[part[0]]))]
            std = []
            for p in part:
                x = [(v - lo) / (hi - lo) for v, lo, hi in zip(rows[p], low, high)]
                mean = sum(x) / len(x)
                std.append(math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1)))
            total = sum(math.exp(v - max(std)) for v in std)
            return [math.exp(v - max(std)) / total for v in std]

        keys, values = self.keys[l][h].tolist(), self.values[l][h].tolist()  # [T][D]
        for j in range(partitions - 1):
            part, reference = parts[j], parts[j + 1]
            key = spread(keys, part, reference)
            value = spread(values, part, reference)
            both = [(a + b) / 2 for a, b in zip(key, value)]
            for rank, i in enumerate(sorted(range(lag), key=lambda i: both[i])):
                score[part[i]] = Fraction(rank, lag)
        return score

    def expected_attention(self, l: int, h: int) -> dict:
        """Expected Attention: per query head of the group, the mean mu and covariance S (population) of the
        prompt's queries before RoPE at positions [sinks, moments_end); RoPE averaged over the n_future
        positions after them, R, gives mu' = R mu, S' = R S R^T; each held key after the sinks gets
        mu'.k / sqrt(D) (+ k^T S' k / 2D with the covariance), softmaxed over those keys; the mean over the
        group's query heads, then (+ epsilon) x ||v||_2 with the value norm. Sinks score 0 (+ epsilon) x ||v||."""
        spec, D = self.spec, self.D
        held = self.held(l, h)
        scored = [p for p in held if p >= spec.sinks]
        rotation = self.future_rotation(self.moments_end)
        attention = {p: 0.0 for p in held}
        for g in range(self.G):
            queries = self.prerope[l][spec.sinks:self.moments_end, h * self.G + g]  # [c, D]
            count = queries.shape[0]
            mean = queries.sum(0) / max(count, 1)
            centred = queries - mean
            covariance = centred.T @ centred / max(count, 1)
            mean, covariance = rotation @ mean, rotation @ covariance @ rotation.T
            logit = {}
            for p in scored:
                k = self.keys[l][h, p]
                logit[p] = float(mean @ k) / math.sqrt(D)
                if spec.use_covariance:
                    logit[p] += float(k @ covariance @ k) / D / 2
            top = max(logit.values(), default=0.0)
            total = sum(math.exp(x - top) for x in logit.values())
            for p in scored:
                attention[p] += math.exp(logit[p] - top) / total / self.G
        if not spec.use_vnorm:
            return attention
        return {p: (a + spec.epsilon) * float(self.values[l][h, p].norm()) for p, a in attention.items()}

    def future_rotation(self, end: int) -> torch.Tensor:
        """[D, D]: the model's RoPE (x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]) averaged over
        positions end .. end + n_future - 1."""
        D, half = self.D, self.D // 2
        positions = torch.arange(end, end + self.spec.n_future)[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)
        cos, sin = cos[0].double().mean(0), sin[0].double().mean(0)  # [D]
        rotation = torch.zeros(D, D, dtype=torch.float64)
        for i in range(D):
            rotation[i, i] = cos[i]
            if i < half:
                rotation[i, i + half] = -sin[i]  # (R x)_i = x_i cos_i - x_{i + D/2} sin_i
            else:
                rotation[i, i - half] = sin[i]  # (R x)_i = x_i cos_i + x_{i - D/2} sin_i
        return rotation

    def critical(self, l: int, h: int, cap: int, base: dict) -> dict:
        """CriticalKV: the head's first floor(first_stage_ratio x cap) tokens (at least 1 when the ratio is
        positive) score FIRST_STAGE: its protected ones first (the sinks, and the policy's own recent window,
        recent_tokens + floor(recent_fraction x (cap - sinks)), back from the newest position it holds: those
        kvpress's scorers give their highest scores), then its best by the scorer (ties to the earlier
        position); every other token (score + epsilon) x the mean over the group's query heads of
        ||W_o,qh v||_1, W_o,qh the output projection's columns that read query head qh."""
        spec = self.spec
        first = min(int(cap * spec.first_stage_ratio), len(base))
        if spec.first_stage_ratio > 0:
            first = max(first, 1)
        recent = spec.recent_tokens + math.floor(spec.recent_fraction * max(cap - spec.sinks, 0))
        newest = max(base)

        def protected(p):
            return p < spec.sinks or p > newest - recent

        picked = set(sorted(base, key=lambda p: (0, p) if protected(p) else (1, -base[p], p))[:first])
        o_proj = self.model.model.layers[l].self_attn.o_proj.weight.detach()  # [hidden, H_q * D]
        held = sorted(base)
        values = self.values[l][h, held]  # [n, D]
        norms = sum((values @ o_proj[:, qh * self.D:(qh + 1) * self.D].T).abs().sum(1)  # [n] ||W_o,qh v||_1
                    for qh in range(h * self.G, (h + 1) * self.G)) / self.G
        return {p: FIRST_STAGE if p in picked else float32((base[p] + spec.critical_epsilon) * float(norm))
                for p, norm in zip(held, norms)}

    # -- KVzip's context reconstruction --

    def reconstruct(self, compressed: list[int], begin: int, end: int) -> None:
        """Score the prompt's positions [begin, end) past the template's prefix (`self.prompts`) by repeating
        them: per chunk of `recon_chunk` positions, the first chunk after the prefix asked with `prompts.first`, a
        later one with `prompts.later` and the previous RECONSTRUCTION_TAIL context tokens (none of the prefix),
        then `prompts.suffix` and the chunk's tokens, are fed after everything held, seeing it all (no words
        without a tokenizer: a chunk alone, a later one after its tail); each chunk token's statistic becomes the
        most probability any of those tokens' queries, of any query head of its KV head, gives it in a softmax
        over the held sinks before the chunk, the chunk and the reconstruction tokens (causal). The
        reconstruction tokens are then dropped; every token fed so far counts as scored."""
        sinks, stop, prompts = self.spec.sinks, min(end, len(compressed)), self.prompts
        for first in range(max(begin, prompts.prefix), stop, self.spec.recon_chunk):
            last = min(first + self.spec.recon_chunk, stop)
            if first == prompts.prefix:
                ask = list(prompts.first)
            else:
                ask = list(prompts.later) + compressed[max(prompts.prefix, first - RECONSTRUCTION_TAIL):first]
            base = self.seen
            self.forward(ask + list(prompts.suffix) + compressed[first:last], None)
            for l in range(self.L):
                query, scaling = self.queries[l]
                for h in range(self.H):
                    held = set(self.held(l, h))
                    # [t, j]: reconstruction query t sees key j
                    sees = torch.tensor([[j in held and (j < min(first, sinks) or first <= j < last or base <= j <= t)
                                          for j in range(self.seen)] for t in range(base, self.seen)])
                    best = torch.zeros(self.seen, dtype=torch.float64)
                    for qh in range(h * self.G, (h + 1) * self.G):
                        logits = (query[qh, base:] @ self.keys[l][h].T) * scaling  # [t, j]
                        probs = torch.softmax(logits.masked_fill(~sees, -math.inf), dim=-1)
                        best = torch.maximum(best, probs.max(0).values)
                    for p in range(first, last):
                        self.stat[l, h][p] = float(best[p])
            self.drop_last(self.seen - base)
        self.stat_end = self.seen

    def drop_last(self, count: int) -> None:
        """Forget the last `count` tokens fed (never evicted, so no record of them remains)."""
        del self.ids[-count:], self.fed_in[-count:]
        for key in self.stat:
            del self.stat[key][-count:]

    # -- compression --

    def slide(self) -> None:
        """Every head of a sliding layer (window W) evicts the positions p <= seen - W: no later query sees them."""
        for l, window in enumerate(self.windows):
            for h in range(self.H) if window is not None else ():
                for p in self.held(l, h):
                    if p <= self.seen - window:
                        self.evicted[l, h][p] = self.forwards - 1

    def cap_in_force(self, l: int, cap: int) -> int:
        """A sliding layer's cap: min(cap, W - 1), or W - 1 whatever the cap (`sliding_layers` "window")."""
        window = self.windows[l]
        if window is None:
            return cap
        return window - 1 if self.settings.sliding_layers == "window" else min(cap, window - 1)

    def compress(self, caps: list[int]) -> dict:
        """Evict each layer down to caps[l] per head (in force: `cap_in_force`), after the sliding layers' `slide`;
        returns the scores used, for messages."""
        self.slide()
        caps = [self.cap_in_force(l, cap) for l, cap in enumerate(caps)]
        if self.spec.scorer == "kvzip" and not self.spec.layerwise and self.spec.granularity == "head":
            return self.compress_pooled(caps)
        if self.spec.scorer == "kvzip" and self.spec.pool_pages and self.spec.granularity == "head_page":
            return self.compress_pooled_pages(caps)
        if self.spec.family == "duo_attention":
            return self.compress_duo(caps)
        used = {}
        for l, cap in enumerate(caps):
            held = [self.held(l, h) for h in range(self.H)]
            if all(len(x) <= cap for x in held):
                continue  # layers whose heads all hold <= their cap are left alone
            scores = [self.scores(l, h, cap) for h in range(self.H)]
            used[l] = scores
            keep = self.select(l, cap, held, scores)
            for h in range(self.H):
                for p in held[h]:
                    if p not in keep[h]:
                        self.evicted[l, h][p] = self.forwards - 1
        return used

    def compress_pooled(self, caps: list[int]) -> dict:
        """KVzip's default: one budget, sum_l caps[l] x H_kv, for all layers and KV heads of the sequence, applied
        when they hold more in all. Every protected token (sinks, each layer's recent ones) stays; the rest of
        the budget goes to the highest scores of any layer and head (ties: lower layer, lower head, earlier
        position)."""
        held = {(l, h): self.held(l, h) for l in range(self.L) for h in range(self.H)}
        if sum(len(x) for x in held.values()) <= sum(caps) * self.H:
            return {}
        scores = {l: [self.scores(l, h, caps[l]) for h in range(self.H)] for l in range(self.L)}
        keep, candidates = set(), []
        for (l, h), positions in held.items():
            recent = self.recent(caps[l])
            for p in positions:
                if p < self.spec.sinks or p >= self.seen - recent:
                    keep.add((l, h, p))
                else:
                    candidates.append((l, h, p))
        left = max(sum(caps) * self.H - len(keep), 0)
        candidates.sort(key=lambda lhp: (-scores[lhp[0]][lhp[1]][lhp[2]], lhp))
        keep.update(candidates[:left])
        for (l, h), positions in held.items():
            for p in positions:
                if (l, h, p) not in keep:
                    self.evicted[l, h][p] = self.forwards - 1
        return scores

    def compress_pooled_pages(self, caps: list[int]) -> dict:
        """KVzip at head_page with pool_pages: one budget, sum_l caps[l] x H_kv tokens, over the pages of every
        layer and KV head, applied when they hold more in all. A page is scored, and is a sink or protected page,
        as at head_page (`take_pages`); the order over all of them: sink pages (earlier page, then lower layer,
        lower head), protected pages (later page first, then lower layer, lower head), the rest by score (highest
        first; ties: lower layer, lower head, earlier page); greedy fill, a page taken when its tokens still fit."""
        spec, seen, S = self.spec, self.seen, self.settings.page_size
        held = {(l, h): self.held(l, h) for l in range(self.L) for h in range(self.H)}
        budget = sum(caps) * self.H
        if sum(len(x) for x in held.values()) <= budget:
            return {}
        scores = {l: [self.scores(l, h, caps[l]) for h in range(self.H)] for l in range(self.L)}
        units = []  # (keep order key, (layer, head, page), positions)
        for (l, h), positions in held.items():
            recent = self.recent(caps[l])
            for page in sorted({p // S for p in positions}):
                on_page = [p for p in positions if p // S == page]
                being_filled = (seen - 1) in on_page and seen % S != 0
                if any(p < spec.sinks for p in on_page):
                    key = (0, page, l, h)
                elif being_filled or any(p >= seen - recent for p in on_page):
                    key = (1, -page, l, h)
                else:
                    key = (2, -mean_score([scores[l][h][p] for p in on_page]), l, h, page)
                units.append((key, (l, h, page), on_page))
        taken, total = set(), 0
        for _, unit, on_page in sorted(units):
            if total + len(on_page) <= budget:
                taken.add(unit)
                total += len(on_page)
        for (l, h), positions in held.items():
            for p in positions:
                if (l, h, p // S) not in taken:
                    self.evicted[l, h][p] = self.forwards - 1
        return scores

    def compress_duo(self, caps: list[int]) -> dict:
        """DuoAttention: a retrieval head keeps everything; a streaming head [0, sinks) and [seen - r, seen),
        r = recent_size + the tokens appended uncompressed after the prompt. At head_page it keeps its pages lying
        wholly within the sinks, its pages all of whose positions so far are within the r most recent, and its
        newest page (the one holding seen - 1). As for every policy, a layer whose heads all hold <= its cap
        (`duo_caps`) is left alone."""
        spec, seen, S = self.spec, self.seen, self.settings.page_size
        start = seen - (spec.recent_tokens + self.appended)
        for l, h in sorted(self.streaming):
            if all(len(self.held(l, x)) <= caps[l] for x in range(self.H)):
                continue
            for p in self.held(l, h):
                if spec.granularity == "head_page":
                    page = p // S
                    keep = (page + 1) * S <= spec.sinks or page * S >= start or page == (seen - 1) // S
                else:
                    keep = p < spec.sinks or p >= start
                if not keep:
                    self.evicted[l, h][p] = self.forwards - 1
        return {}

    def recent(self, cap: int) -> int:
        spec = self.spec
        widen = self.seen - self.stat_end if spec.scorer in NEEDS_STATISTIC else 0
        return min(cap, spec.recent_tokens + math.floor(spec.recent_fraction * max(cap - spec.sinks, 0)) + widen)

    def select(self, l: int, cap: int, held: list[list[int]], scores: list[dict]) -> list[set[int]]:
        spec, seen, S = self.spec, self.seen, self.settings.page_size
        recent = self.recent(cap)

        def protected(p):
            return p < spec.sinks or p >= seen - recent

        if spec.adaptive and spec.granularity == "head":
            return self.select_adakv(cap, held, scores, protected)
        if spec.granularity == "head":
            return [set(keep_order(held[h], scores[h], protected, spec.sinks)[:cap]) for h in range(self.H)]
        if spec.granularity == "token":
            tokens = sorted(set().union(*held))
            score = {}
            for p in tokens:
                holders = [h for h in range(self.H) if p in held[h]]
                score[p] = mean_score([scores[h][p] for h in holders])
            kept = set(keep_order(tokens, score, protected, spec.sinks)[:cap])
            return [set(held[h]) & kept for h in range(self.H)]
        if spec.granularity == "page":
            pages = {}
            for page in sorted({p // S for x in held for p in x}):
                pairs = [(h, p) for h in range(self.H) for p in held[h] if p // S == page]
                positions = sorted({p for _, p in pairs})
                pages[page] = (positions, mean_score([scores[h][p] for h, p in pairs]))
            taken = take_pages(pages, cap, protected, spec.sinks, seen, S)
            return [{p for p in held[h] if p // S in taken} for h in range(self.H)]
        if spec.granularity == "head_page":
            keep = []
            for h in range(self.H):
                pages = {}
                for page in sorted({p // S for p in held[h]}):
                    positions = [p for p in held[h] if p // S == page]
                    pages[page] = (positions, mean_score([scores[h][p] for p in positions]))
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
               max_new_tokens: int, tokenizer=None, later_turns: tuple = (), eos: tuple = ()) -> Trace:
    """One request, as docs/policies.md says evalkit's loop must process it. `model` in float64; `tokenizer`
    (None: token ids alone) only words KVzip's reconstruction prompts.

    `later_turns` (each a list of prompt tokens) makes it a conversation, as docs/tasks.md's "Several questions on
    one context" says: `question` is the first turn's prompt, and after each answer ONE forward feeds the answer's
    last token when it ended on max new tokens (an answer ending on an `eos` token has fed all its tokens; the
    EOS itself is never fed) followed by the next turn's prompt, collecting the decode statistic exactly as the
    question appended after compression does; with decode eviction the cache is then evicted back to the decode
    caps, k_l + q (q = the first question's tokens when query-agnostic, else 0: the size the cache had when the
    first answer began), and without it only what a sliding window lost is dropped; then that turn's answer is
    decoded as the first was, evicting after every step. An answer ends at max new tokens or on a token of
    `eos`, which is not part of it."""
    if later_turns and spec.family == "quest":
        raise ValueError("the oracle has no rule for Quest's reads in a forward of several tokens (a later turn)")
    seq = Sequence(model, spec, settings, kvzip_prompts(tokenizer))
    compressed = context + question if settings.query_aware else list(context)
    appended = [] if settings.query_aware else list(question)
    n = len(compressed)
    trace = Trace(budget=budget_tokens(settings.budget, n))
    k = trace.budget
    trace.evicting = k < n and spec.family not in NEVER_EVICTS
    caps = layer_budgets(spec, k, n, seq.L, settings.page_size) if trace.evicting else None
    if spec.family == "duo_attention" and trace.evicting:
        seq.streaming = duo_streaming(spec.head_scores, k, n, spec.sinks + spec.recent_tokens,
                                      spec.head_compression_ratio)
        caps = duo_caps(seq.streaming, n, seq.L, spec, settings.page_size)
        trace.layer_budgets = list(caps)
    trace.layer_budgets = list(caps or [])
    collect_prefill, collect_decode = COLLECT.get(spec.scorer, (None, None))
    decode_evicts = trace.evicting and settings.decode_eviction
    collect = collect_decode if decode_evicts else None  # after compression: the question, turns, decoded tokens

    with oracle_attention(model):
        chunk = settings.chunk_size if settings.prefill == "chunked" else n
        for index, start in enumerate(range(0, n, chunk)):
            logits = seq.forward(compressed[start:start + chunk], collect_prefill if trace.evicting else None)
            seq.moments_end = seq.seen  # Expected Attention's queries: the compressed prompt's, fed so far
            if trace.evicting:
                if spec.scorer == "kvzip":
                    seq.reconstruct(compressed, start, start + chunk)
                trace.scores[f"prefill chunk {index}"] = seq.compress(caps)
            else:
                seq.slide()
            trace.chunks.append(seq.kept())
        if appended:  # the question, never compressed; collects the decode statistic
            logits = seq.forward(appended, collect)
            seq.slide()
        trace.prefill = seq.kept()

        q = len(appended)
        seq.appended = q
        decode_caps = [c + q for c in caps] if decode_evicts else None
        if spec.family == "quest" and k < n:  # nothing evicted; decode queries read the best pages
            seq.quest_pages = max(spec.min_pages, math.ceil((k + q) / settings.page_size))

        def after_forward(phase: str) -> Kept:
            """Evict back to the decode caps (decode eviction) or drop what a sliding window lost; the kept."""
            if decode_evicts:
                trace.scores[phase] = seq.compress(decode_caps)
            else:
                seq.slide()
            return seq.kept()

        def answer(logits, tokens: list[int], steps: list[Kept], label: str) -> bool:
            """Decode one answer from `logits` into `tokens`, the kept after each step into `steps`; True when
            it ended on an EOS (every token of it fed), False at max new tokens (its last token not fed)."""
            for step in range(max_new_tokens):
                token = int(logits.argmax())
                if token in eos:
                    return True
                tokens.append(token)
                if step == max_new_tokens - 1:
                    break
                logits = seq.forward([token], collect)
                steps.append(after_forward(f"{label}decode step {step}"))
            return False

        ended_on_eos = answer(logits, trace.tokens, trace.steps, "")
        previous = trace.tokens
        for number, prompt in enumerate(later_turns, start=2):
            turn = Turn(fed=([] if ended_on_eos else previous[-1:]) + list(prompt))
            logits = seq.forward(turn.fed, collect)
            turn.after_fed = after_forward(f"turn {number} prompt")
            ended_on_eos = answer(logits, turn.tokens, turn.steps, f"turn {number} ")
            trace.turns.append(turn)
            previous = turn.tokens
    return trace
