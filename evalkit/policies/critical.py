from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.policies.arguments import arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets, register_wrapper
from evalkit.policies.scorers import SCORERS

FIRST_STAGE = 2.0 ** 100  # the score of a first-stage pick: above any second-stage score, finite in page sums


def critical_of(wrapped: type[Policy]) -> type[Policy]:
    """`wrapped`'s scores corrected by what each value adds to the layer's output (kvpress's CriticalKVPress(press))."""

    @dataclass
    class Critical(wrapped):
        """Two stages: a head's first `first_stage_ratio` x budget tokens are kept first — its protected
        ones (sinks, recent window), which kvpress's scorers give their highest scores, then its best by
        the scorer; the rest rank by (score + `epsilon`) x the L1 norm of the value through the output
        projection, ‖v W_o,h‖₁, averaged over the query heads of the KV head."""

        critical_epsilon: float = arg(1e-4, 0.0, 1e6)  # its own: a wrapped scorer's `epsilon` stays the scorer's
        first_stage_ratio: float = arg(0.5, 0.0, 1.0)
        description = f"{wrapped.scorer}, then value-aware: (score + ε) × ‖v W_o‖₁ past the first half of the budget"
        scorer = f"{wrapped.scorer} × projected value norm"
        paper = ("CriticalKV: Identify Critical KV Cache in LLM Inference from an Output Perturbation "
                 "Perspective (arXiv:2502.03805)")
        kvpress = f"CriticalKVPress({wrapped.kvpress.split(' ')[0]})" if wrapped.kvpress else ""
        # kvpress's CriticalKVPress(epsilon=); a wrapped scorer's own epsilon (Expected Attention's) as scorer_epsilon
        arg_aliases = {**wrapped.arg_aliases, "epsilon": "critical_epsilon",
                       **({"scorer_epsilon": "epsilon"} if "epsilon" in wrapped.__dataclass_fields__ else {})}

        def score(self, inp: ScoreInput) -> torch.Tensor:
            base = super().score(inp).float()  # [B, H_kv, N]
            live = inp.positions >= 0
            first = (inp.caps.double() * self.first_stage_ratio).long().clamp(max=base.shape[-1])  # [B]
            if self.first_stage_ratio > 0:
                first = first.clamp(min=1)
            newest = inp.positions.amax(-1, keepdim=True)  # [B, H_kv, 1]
            recent = self.recent_count(inp.caps)[:, None, None]
            protected = (inp.positions < self.sink_tokens) | (inp.positions > newest - recent)
            order = base.masked_fill(protected, float("inf")).masked_fill(~live, float("-inf"))
            by_position = torch.argsort(inp.positions, dim=-1, stable=True)  # ties: the earlier position first
            ranked = by_position.gather(-1, torch.argsort(order.gather(-1, by_position), dim=-1, descending=True,
                                                          stable=True))
            picked = torch.zeros_like(live).scatter(
                -1, ranked, torch.arange(base.shape[-1]).expand_as(ranked) < first[:, None, None]) & live
            norms = inp.of_each_value("critical_projected_value_norms",
                                      lambda values: projected_value_norms(values, inp.output_projection))
            corrected = (base + self.critical_epsilon) * norms
            return corrected.masked_fill(picked, FIRST_STAGE)

    Critical.__name__ = Critical.__qualname__ = f"Critical{wrapped.__name__}"
    return Critical


# Fewer rows than this and the CPU's GEMM rounds a row differently (measured: 1 to 3 rows); padded, a token's
# norm is the same bits whichever tokens it is computed with, as the decode steps' memo needs (`of_each_value`).
ROWS_AT_LEAST = 16


def projected_value_norms(values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, N]: ‖v W_o,h‖₁ per query head h, averaged over each KV head's query heads.
    values: [B, H_kv, N, D]; o_proj: [hidden, H_q * D], the layer's output projection weight."""
    B, H_kv, N, D = values.shape
    if N < ROWS_AT_LEAST:
        return projected_value_norms(F.pad(values, (0, 0, 0, ROWS_AT_LEAST - N)), o_proj)[..., :N]
    heads = o_proj.T.reshape(-1, D, o_proj.shape[0]).to(values.dtype)  # [H_q, D, hidden]
    G = heads.shape[0] // H_kv
    norms = torch.stack([(values[:, h // G] @ heads[h]).abs().sum(-1) for h in range(heads.shape[0])], 1)
    return norms.view(B, H_kv, G, N).float().mean(2)


for _base, _scorer in SCORERS.items():
    register_presets(critical_of(_scorer), f"critical_{_base}",
                     **({"use_vnorm": False} if _base == "expected_attention" else {}))
register_wrapper("critical", tuple(SCORERS))
