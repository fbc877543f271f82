from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.errors import EvalkitError
from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput, in_position_space
from evalkit.policies.names import register_presets


@dataclass
class SnapKV(Policy):
    """Attention from an observation window of the last prompt queries, pooled along the prefix.

    The statistic is the probability each slot receives from the last `observation_window`
    queries (summed, averaged over the group's heads), set at prefill. Scores are its 1-D max
    (or average) pooling of width `kernel_size` over the prefix before the window, divided by the
    window (a mean over its queries, as kvpress's; what a wrapper adding ε to it sees), so clusters
    survive rather than isolated tokens; the window itself is always kept (SnapKV's defaults:
    w=32, k=7, max pooling; kvpress's: `window=64 kernel=5 pooling=avg`). It collects nothing
    while decoding, as published: decoded tokens are protected, never scored as zero.
    """

    observation_window: int = arg(32, 1, PROMPT)
    kernel_size: int = arg(7, 1, PROMPT)
    pooling: str = "max"
    description = "attention from the last 32 prompt queries, max-pooled (k=7) over the prefix; the window kept"
    scorer = "window attention + pooling"
    paper = "SnapKV: LLM Knows What You are Looking for Before Generation (arXiv:2404.14469)"
    kvpress = "SnapKVPress (window=64 kernel=5 pooling=avg)"
    differs = "decode eviction (on by default) evicts prompt tokens only, lowest prefill score first"
    collect_prefill = "window"
    arg_aliases = {"window": "observation_window", "kernel": "kernel_size"}
    arg_choices = {"pooling": ("max", "avg")}

    def recent_count(self, caps: torch.Tensor) -> torch.Tensor:
        return super().recent_count(caps) + self.observation_window

    def check(self) -> None:
        super().check()
        if self.kernel_size % 2 == 0:
            raise EvalkitError(f"{self.name}: window must be >= 1 and kernel an odd number >= 1")

    def score(self, inp: ScoreInput) -> torch.Tensor:
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        prefix_end = (inp.stat_end.to(inp.positions.device) - self.observation_window)[:, None, None]  # [B, 1, 1]

        def pooled(by_position: torch.Tensor) -> torch.Tensor:  # [B, H, T]
            B, H, T = by_position.shape
            prefix = torch.arange(T, device=by_position.device) < prefix_end
            values = by_position.masked_fill(~prefix, 0.0).reshape(B * H, 1, T)
            out = pool(values, self.kernel_size, stride=1, padding=self.kernel_size // 2).view(B, H, T)
            return out.masked_fill(~prefix, 0.0) / self.observation_window

        return in_position_space(pooled, inp.statistic, inp.positions, inp.span)


register_presets(SnapKV, "snapkv")
