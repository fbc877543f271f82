from dataclasses import dataclass

import torch

from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets
from evalkit.policies.query_moments import rotate_half


@dataclass
class ExpectedAttention(Policy):
    """The attention future queries are expected to pay each key, from the prompt queries' statistics.

    The prompt's queries before RoPE (after the sinks) have mean μ and covariance Σ per query head
    (`QueryMoments`, summed during the prefill's own forward). RoPE averaged over the next
    `n_future_positions` positions, R, moves them to where future queries will be: μ' = Rμ, Σ' = RΣRᵀ.
    With attention ∝ exp(q·k/√d) and q ~ N(μ', Σ'), E[exp(q·k/√d)] = exp(μ'·k/√d + kᵀΣ'k/2d); softmax
    over the head's keys after the sinks, averaged over the query heads of a KV head, times ‖v‖₂
    (`use_vnorm`), plus `epsilon` before it — kvpress's ExpectedAttentionPress. The sinks are kept.
    """

    sink_tokens: int = arg(4, 0, PROMPT)
    n_future_positions: int = arg(512, 1)
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = arg(0.0, 0.0, 1e6)
    description = "expected attention of future queries (prompt query mean/covariance, RoPE averaged ahead) × ‖v‖"
    scorer = "expected attention from query statistics"
    paper = "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution (arXiv:2510.00636)"
    kvpress = "ExpectedAttentionPress"
    differs = "decode eviction scores decoded keys with the prompt's query statistics (kvpress compresses the prefill only)"
    reads_query_moments = applies_model_rope = True
    arg_aliases = {"n_future": "n_future_positions", "n_sink": "sink_tokens"}

    def score(self, inp: ScoreInput) -> torch.Tensor:
        keys = inp.keys
        work = torch.promote_types(keys.dtype, torch.float32)
        B, H_kv, N, D = keys.shape
        mean, covariance = inp.queries.mean_and_covariance(inp.layer)  # [B, H_q, D], [B, H_q, D, D] float64
        rotation = self.future_rotation(inp, D)  # [B, D, D]
        mean = torch.einsum("bij,bhj->bhi", rotation, mean).to(work)
        G = mean.shape[1] // H_kv
        k = keys.to(work)[:, :, None]  # [B, H_kv, 1, N, D]
        logits = torch.einsum("bhgd,bhnd->bhgn", mean.view(B, H_kv, G, D), k[:, :, 0]) / D ** 0.5
        if self.use_covariance:
            covariance = (rotation[:, None] @ covariance @ rotation[:, None].transpose(-1, -2)).to(work)
            spread = (k @ covariance.view(B, H_kv, G, D, D)) * k  # [B, H_kv, G, N, D]
            logits = logits + spread.sum(-1) / D / 2
        scored = (inp.positions >= self.sink_tokens)[:, :, None]  # live slots after the sinks
        scores = logits.masked_fill(~scored, float("-inf")).softmax(-1).nan_to_num(0.0).mean(2)  # [B, H_kv, N]
        if self.use_vnorm:
            scores = (scores + self.epsilon) * inp.values.to(work).norm(dim=-1)
        return scores

    def future_rotation(self, inp: ScoreInput, D: int) -> torch.Tensor:
        """[B, D, D] float64: RoPE's rotation averaged over the `n_future_positions` positions after the prompt."""
        ahead = inp.queries.end[:, None] + torch.arange(self.n_future_positions)  # [B, n]
        cos, sin = (x.double() for x in inp.rope(ahead.to(inp.positions.device)))  # [B, n, D]
        eye = torch.eye(D, dtype=torch.float64, device=cos.device)
        half = rotate_half(eye).T  # P with P x = rotate_half(x)
        return cos.mean(1)[:, :, None] * eye + sin.mean(1)[:, :, None] * half


register_presets(ExpectedAttention, "expected_attention")
