from dataclasses import dataclass

import torch

from evalkit.errors import EvalkitError
from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets
from evalkit.policies.selection import ABSENT, RANKED, Granularity, keep_rank, select_pages_across_layers


@dataclass
class KVzip(Policy):
    """Context reconstruction: a token is worth the attention it receives while the model repeats the context.

    After the prompt's prefill the loop feeds, chunk by chunk (`chunk_size` context tokens), a
    reconstruction prompt — "Repeat the previous context exactly." (later chunks: "Repeat the part of
    the previous context exactly, starting with" and the previous chunk's last 8 tokens), the chat
    template's assistant turn, then the chunk itself — on top of the cache, and drops those tokens
    again (`evalkit.loop.reconstruction`). Each reconstruction query's softmax over the sinks, the
    chunk and the reconstruction tokens (causal) gives every chunk token a probability; its score is
    the maximum over the queries and the query heads of its KV head (kvpress's KVzipPress). One
    extra forward over about the context again: prefill costs roughly twice as much.

    At head granularity (`layerwise=false`, kvpress's default) the budget is pooled over every layer and
    KV head of a sequence: the lowest scores anywhere are evicted, so layers and heads keep different
    numbers of tokens. `layerwise=true`, and every other granularity, evict each layer to its own budget;
    at head_page `pool_pages=true` pools it as at head: the pages of every layer and KV head in one keep order
    (`select_pages_across_layers`).
    Decoded tokens have no reconstruction score: they are kept, the prompt's tokens evicted, lowest first.
    """

    sink_tokens: int = arg(4, 0, PROMPT)
    chunk_size: int = arg(2048, 1)
    layerwise: bool = False
    # Off by default: `kvzip_head_page` keeps each layer's budget, as the study's runs were made with it.
    pool_pages: bool = False
    description = "attention received while the model repeats the context (one extra forward); budget pooled over layers and heads"
    scorer = "context-reconstruction attention"
    paper = "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction (arXiv:2505.23416)"
    kvpress = "KVzipPress"
    differs = ("at token, page and head_page granularity each layer keeps its own budget (layerwise; at head_page "
               "policy-arg pool_pages=true pools it over layers and heads, page by page); layerwise "
               "caps each KV head (kvpress pools a layer's budget over its heads); with decode eviction, decoded "
               "tokens are kept and prompt tokens evicted (kvpress compresses the prefill only)")
    reconstructs = True
    arg_aliases = {"chunk": "chunk_size", "n_sink": "sink_tokens"}

    def check(self) -> None:
        super().check()
        if self.pool_pages and self.granularity != Granularity.HEAD_PAGE:
            raise EvalkitError(f"{self.name}: policy-arg pool_pages applies at head_page only (at head the budget is "
                               "pooled already, unless layerwise=true; token and page keep each layer's budget)")
        if self.pool_pages and self.layerwise:
            raise EvalkitError(f"{self.name}: policy-args pool_pages and layerwise contradict each other: pool_pages "
                               "pools the budget over layers, layerwise keeps each layer's")

    @property
    def needs_statistic(self) -> bool:
        return True  # the reconstruction's: tokens it never scored (decoded ones) are kept

    @property
    def selects_across_layers(self) -> bool:
        if self.granularity == Granularity.HEAD_PAGE:
            return self.pool_pages
        return not self.layerwise and self.granularity == Granularity.HEAD

    def head_capacity(self, caps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A pooled budget may flow to one head: it can keep its whole prompt."""
        return lengths if self.selects_across_layers else super().head_capacity(caps, lengths)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return inp.statistic

    def select_layers(self, scores, positions, seen, caps, page_size, recent) -> torch.Tensor:
        """[L, B, H_kv, N] bool: the slots kept when the budget is pooled over layers and heads."""
        if self.granularity == Granularity.HEAD_PAGE:
            return select_pages_across_layers(scores, positions, seen, caps, page_size, self.sink_tokens, recent)
        return select_across_layers(scores, positions, seen, caps, self.sink_tokens, recent)


def select_across_layers(scores, positions, seen, caps, sink_tokens: int = 0, recent=None) -> torch.Tensor:
    """One budget for every layer and KV head of a sequence (KVzip's default): [L, B, H_kv, N] bool.

    scores, positions: [L, B, H_kv, N]; caps, recent: [L, B]. A sequence keeps sum_l caps[l] x H_kv tokens in
    all: first every protected token (sinks, each layer's recent ones), then the highest scores of any layer
    and head (ties: lower layer, lower head, earlier slot).
    """
    L, B, H, N = scores.shape
    live = positions >= 0
    recent = torch.zeros_like(caps) if recent is None else recent
    protected = live & ((positions < sink_tokens) | (positions >= (seen - recent)[..., None, None]))
    left = (caps.sum(0) * H - protected.sum((0, 2, 3))).clamp(min=0)  # [B]
    pool = (live & ~protected).transpose(0, 1).reshape(B, -1)  # [B, L * H * N], layer-major
    leaving = (pool.sum(-1) - left).clamp(min=0)  # [B] the pool's tokens past the budget
    if not bool(scores.isnan().logical_and(live).any()):
        dropped = _lowest(scores.transpose(0, 1).reshape(B, -1), pool, leaving)
        return live & ~dropped.view(B, L, H, N).transpose(0, 1)
    ranked = (-scores.double()).transpose(0, 1).reshape(B, -1).masked_fill(~pool, 0.0)
    rank = keep_rank(torch.where(pool, RANKED, ABSENT), ranked)
    chosen = (pool & (rank < left[:, None])).view(B, L, H, N).transpose(0, 1)
    return protected | chosen


def _lowest(scores: torch.Tensor, pool: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, M] bool: each row's `count[b]` tokens of `pool` ranked last by (score descending, index ascending), the
    sorts' order without sorting: below the count-th lowest score, and of the tokens at it the highest indices.
    scores: [B, M] float, no NaN in the pool."""
    dropped = torch.zeros_like(pool)
    for b, k in enumerate(count.tolist()):
        if k:
            row = scores[b].masked_fill(~pool[b], float("inf"))
            threshold = row.kthvalue(k).values
            below, at = pool[b] & (row < threshold), pool[b] & (row == threshold)
            from_end = at.flip(0).cumsum(0).flip(0)  # tokens at the threshold from each index on
            dropped[b] = below | (at & (from_end <= k - below.sum()))
    return dropped


register_presets(KVzip, "kvzip")
