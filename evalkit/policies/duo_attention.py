from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from evalkit.errors import EvalkitError
from evalkit.policies.arguments import PROMPT, arg, arg_name
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES
from evalkit.policies.duo_calibration import CALIBRATION_TEXTS, CALIBRATION_TOKENS, calibrated_head_scores
from evalkit.policies.selection import Granularity


@dataclass
class DuoAttention(Policy):
    """Retrieval heads keep every token; streaming heads keep `sink_tokens` sinks and the `recent_tokens` most
    recent (kvpress's DuoAttentionPress(on_the_fly_scoring=True): 128 + 256).

    Heads are ranked once per model by an on-the-fly score (`calibrated_head_scores`): the area under the cumulative
    attention of the last of 500 copies of the layer's mean query, over 500 copies of its mean key, RoPE
    applied at positions 0 .. 499; low = the mean query looks at its recent neighbours, and the lowest-scoring
    (layer, KV head) pairs of the whole model stream. How many stream follows the budget (`streaming_heads`),
    per sequence; `layer_caps` records the batch's plan, `score` marks each head's slots with its role
    (1 retrieval, 0 streaming) and `select` keeps, per head, everything or the window.

    `head_compression_ratio` (kvpress's parameter; 0, the default, follows the budget) fixes the count instead:
    round(L x H_kv x ratio) heads stream (Python's round, as kvpress), whatever the budget and the prompt's
    length, in every sequence the budget compresses (budget below the prompt; a prompt no longer than sinks +
    recent is still left whole). The budget then only switches compression on: the mean kept per head is
    what the heads keep, above or below it.
    """

    applies_model_rope = True  # the calibration rotates its mean query and key at positions 0 .. 499
    granularity: Granularity = Granularity.HEAD
    sink_tokens: int = arg(128, 0, PROMPT)
    recent_tokens: int = arg(256, 1, PROMPT)
    head_compression_ratio: float = arg(0.0, 0.0, 1.0)  # > 0: round(L x H_kv x ratio) heads stream, any budget
    description = "retrieval heads keep everything, streaming heads 128 sinks + 256 recent; heads ranked on the fly"
    scorer = "head role from an on-the-fly attention-span score"
    paper = "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads (arXiv:2410.10819)"
    kvpress = "DuoAttentionPress(on_the_fly_scoring=True)"
    differs = (f"heads scored on the first {CALIBRATION_TOKENS} tokens of {CALIBRATION_TEXTS} Paul Graham essays "
               "shipped with evalkit (kvpress: 50 whole BookSum chapters from the hub); the budget sets how many heads "
               "stream, per sequence: the fewest that keep its mean (kvpress: head_compression_ratio, a fixed share; "
               "policy-arg head_compression_ratio does that: round(L x H_kv x ratio) heads, ties in the head scores "
               "to the lower layer and head where kvpress's numpy argsort leaves them unspecified); streaming heads "
               "stay a sliding window while decoding (kvpress compresses the prompt only)")
    arg_aliases = {"sink_size": "sink_tokens", "recent_size": "recent_tokens"}
    not_static = "DuoAttention keeps each head's role's window by its own rule, not `keep_mask`"
    cannot_run_at = {
        granularity: "DuoAttention gives each KV head its own role (retrieval or streaming), which tokens or pages "
                     "shared by all heads would undo"
        for granularity in (Granularity.TOKEN, Granularity.PAGE)
    }
    head_scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # [L, H_kv]
    streaming: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # [B, L, H_kv]
    prepared_for: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)  # the model

    def check(self) -> None:
        super().check()
        if self.recent_fraction or self.observation_window:
            raise EvalkitError(f"{self.name}: policy-args recent_fraction and observation_window do not apply: "
                               "streaming heads keep sink_size + recent_size tokens")

    def check_fits(self, length: int, positions: int | None = None) -> None:
        window = self.sink_tokens + self.recent_tokens
        if length <= window:
            args = f"policy-arg {arg_name(self, 'sink_tokens')} / {arg_name(self, 'recent_tokens')}"
            way = f"raise --length above {window} or lower {args}" if positions is None or window < positions \
                else f"lower {args}: the model has {positions} positions"
            raise EvalkitError(f"{self.name}: its streaming heads keep {self.sink_tokens} sinks + {self.recent_tokens} "
                               f"recent tokens, a whole --length {length} prompt: nothing to evict; {way}")
        super().check_fits(length, positions)

    def prepare(self, model, tokenizer=None) -> None:
        if self.prepared_for is None or self.prepared_for() is not model:  # a run's batches share its model
            self.head_scores = calibrated_head_scores(model, tokenizer)
            self.prepared_for = weakref.ref(model)

    def streaming_heads(self, tokens: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
        """[B] how many of the model's `heads` (layers x KV heads) stream: the fewest that bring the mean kept per
        head down to `tokens` [B], from `lengths` [B]; all of them when even that is more; none when a prompt is
        no longer than sinks + recent (kvpress compresses nothing then). kvpress's own accounting: streaming a
        share s of the heads removes s x (1 - (sinks + recent) / n) of the cache. With `head_compression_ratio`,
        round(heads x ratio) whatever `tokens` (kvpress's n_pruned), still none for such a short prompt."""
        dropped = (lengths - self.sink_tokens - self.recent_tokens).clamp(min=0)  # by one streaming head
        if self.head_compression_ratio > 0:
            return torch.where(dropped > 0, round(heads * self.head_compression_ratio), 0)
        excess = (lengths - tokens).clamp(min=0) * heads  # to drop, over all heads
        count = torch.where(dropped > 0, (excess + dropped - 1) // dropped.clamp(min=1), 0)
        return count.clamp(max=heads)

    def layer_caps(self, tokens: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Records the batch's streaming heads; caps [L, B]: sinks + recent in a layer with a streaming head (the
        cap its streaming heads are evicted to), the whole prompt elsewhere. Retrieval heads keep more than
        their layer's cap: `select` never evicts them."""
        if self.head_scores is None:
            raise RuntimeError(f"{self.name}: prepare(model) first: its heads are ranked on the model")
        L, H = self.head_scores.shape
        if L != num_layers:
            raise RuntimeError(f"{self.name}: head scores of {L} layers, the model has {num_layers}")
        order = torch.argsort(self.head_scores.flatten(), stable=True)  # lowest first; ties: lower layer, head
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(L * H)).view(L, H)
        count = self.streaming_heads(tokens, lengths, L * H)  # [B]
        self.streaming = rank[None] < count[:, None, None]  # [B, L, H]
        window = torch.minimum(lengths, torch.tensor(self.sink_tokens + self.recent_tokens))
        return torch.where(self.streaming.any(-1).T, window, lengths)

    @property
    def holds_caps_while_decoding(self) -> bool:
        return False  # a retrieval head keeps every token, decoded ones too

    def head_capacity(self, caps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A sequence with a retrieval head holds its whole prompt in that head."""
        retrieval = ~self.streaming.flatten(1).all(1)  # [B]
        return torch.where(retrieval, lengths, caps.amax(0))

    def score(self, inp: ScoreInput) -> torch.Tensor:
        """1 on every slot of a retrieval head, 0 on a streaming head's: the role `select` reads."""
        retrieval = ~self.streaming[:, inp.layer].to(inp.positions.device)  # [B, H_kv]
        return retrieval[..., None].float().expand(inp.positions.shape)

    def select(self, scores, positions, seen, caps, page_size, recent, span=None) -> torch.Tensor:
        """Every slot of a retrieval head; a streaming head's sinks and its `caps - sink_tokens` most recent
        positions (recent_tokens; while decoding plus the question appended after compression, as every cap).
        At head_page, a streaming head's pages lying wholly within those, and its newest page."""
        retrieval = (scores > 0).any(-1, keepdim=True)  # [rows, H_kv, 1]
        start = (seen - (caps - self.sink_tokens).clamp(min=0))[:, None, None]  # first recent position
        if self.granularity == Granularity.HEAD_PAGE:
            page, S = positions.div(page_size, rounding_mode="floor"), page_size
            window = ((page + 1) * S <= self.sink_tokens) | (page * S >= start) | \
                     (page == (seen[:, None, None] - 1).div(S, rounding_mode="floor"))
        else:
            window = (positions < self.sink_tokens) | (positions >= start)
        return (positions >= 0) & (retrieval | window)


POLICIES.register("duo_attention", lambda: DuoAttention(name="duo_attention"))
