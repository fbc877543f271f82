from dataclasses import dataclass

import torch

from evalkit.policies.base import PROMPT, Policy, ScoreInput, arg, register_presets
from evalkit.policies.selection import Granularity, select_across_layers

_QUERY_BLOCK = 256  # reconstruction queries per block: scores stay O(block * slots)


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
    numbers of tokens. `layerwise=true`, and every other granularity, evict each layer to its own budget.
    Decoded tokens have no reconstruction score: they are kept, the prompt's tokens evicted, lowest first.
    """

    sink_tokens: int = arg(4, 0, PROMPT)
    chunk_size: int = arg(2048, 1)
    layerwise: bool = False
    description = "attention received while the model repeats the context (one extra forward); budget pooled over layers and heads"
    scorer = "context-reconstruction attention"
    paper = "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction (arXiv:2505.23416)"
    kvpress = "KVzipPress"
    differs = ("at token, page and head_page granularity each layer keeps its own budget (layerwise); layerwise "
               "caps each KV head (kvpress pools a layer's budget over its heads); with decode eviction, decoded "
               "tokens are kept and prompt tokens evicted (kvpress compresses the prefill only)")
    reconstructs = True
    arg_aliases = {"chunk": "chunk_size", "n_sink": "sink_tokens"}

    @property
    def needs_statistic(self) -> bool:
        return True  # the reconstruction's: tokens it never scored (decoded ones) are kept

    @property
    def selects_across_layers(self) -> bool:
        return not self.layerwise and self.granularity == Granularity.HEAD

    def head_capacity(self, caps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A pooled budget may flow to one head: it can keep its whole prompt."""
        return lengths if self.selects_across_layers else super().head_capacity(caps, lengths)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return inp.attention

    def select_layers(self, scores, positions, seen, caps, recent) -> torch.Tensor:
        """[L, B, H_kv, N] bool: the slots kept when the budget is pooled over layers and heads."""
        return select_across_layers(scores, positions, seen, caps, self.sink_tokens, recent)


def reconstruction_scores(query: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor, keys: torch.Tensor,
                          positions: torch.Tensor, chunk: torch.Tensor, context_end: torch.Tensor, sinks: int,
                          scaling: float) -> torch.Tensor:
    """[B, H_kv, N]: per slot, the most probability any reconstruction query of any query head of its KV head
    gives it, the softmax being over the sinks before the chunk, the chunk and the reconstruction tokens.

    query: [B, H_q, T, D] the reconstruction tokens' queries (after RoPE) at q_pos [B, T] (q_valid [B, T]:
    False = padding); keys: [B, H_kv, N, D] and positions [B, H_kv, N] (-1 empty): every slot, the
    reconstruction tokens' included; chunk: [B, 2] the chunk's first and end positions; context_end: [B]."""
    B, H_q, T, D = query.shape
    H_kv = keys.shape[1]
    G = H_q // H_kv
    start, end = chunk[:, 0, None, None], chunk[:, 1, None, None]  # [B, 1, 1]
    added = positions >= context_end[:, None, None]
    seen_keys = (positions >= 0) & ((positions < torch.minimum(start, torch.tensor(sinks)))
                                    | ((positions >= start) & (positions < end)) | added)  # [B, H_kv, N]
    best = torch.zeros(B, H_kv, keys.shape[2], dtype=torch.float32, device=keys.device)
    work = torch.promote_types(keys.dtype, torch.float32)
    q = query.to(work).view(B, H_kv, G, T, D)
    for first in range(0, T, _QUERY_BLOCK):
        block = slice(first, first + _QUERY_BLOCK)
        logits = torch.einsum("bhgtd,bhnd->bhgtn", q[:, :, :, block], keys.to(work)) * scaling
        causal = ~added[:, :, None, None] | (positions[:, :, None, None] <= q_pos[:, None, None, block, None])
        logits = logits.masked_fill(~(seen_keys[:, :, None, None] & causal), float("-inf"))
        probs = logits.softmax(-1).nan_to_num(0.0) * q_valid[:, None, None, block, None]  # padding queries: nothing
        best = torch.maximum(best, probs.amax((2, 3)).float())
    in_chunk = (positions >= start) & (positions < end)
    return best.masked_fill(~in_chunk, 0.0)


register_presets(KVzip, "kvzip")
