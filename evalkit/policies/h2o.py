from dataclasses import dataclass

import torch

from evalkit.policies.arguments import arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets
from evalkit.policies.selection import Granularity


@dataclass
class H2O(Policy):
    """Heavy hitters: the tokens with the most accumulated attention, plus a recent window.

    The statistic is the sum over every query so far (prompt column sums, then one row
    per decoded token) of the softmax probability the token received, averaged over the
    query heads that share its KV head. Half the budget goes to the recent window, as in
    the paper's default (heavy ratio = recent ratio). `normalize=true` divides the sum by
    the number of queries that could see the token (kvpress's ObservedAttention).
    """

    recent_fraction: float = arg(0.5, 0.0, 1.0)
    normalize: bool = False
    description = "accumulated attention (heavy hitters) + recent window (half the budget)"
    scorer = "accumulated attention"
    paper = "H2O: Heavy-Hitter Oracle (arXiv:2306.14048)"
    kvpress = "ObservedAttentionPress (normalize=true recent_fraction=0)"
    collect_prefill = collect_decode = "attention"
    arg_aliases = {"recent": "recent_fraction"}

    def score(self, inp: ScoreInput) -> torch.Tensor:
        if not self.normalize:
            return inp.statistic
        queries = (inp.stat_end.to(inp.positions.device)[:, None, None] - inp.positions).clamp(min=1)
        return inp.statistic / queries


register_presets(H2O, "h2o", aliases={Granularity.TOKEN: ("h2o_block1",)})
