from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.policies.base import Policy, ScoreInput, in_position_space, register_presets


@dataclass
class SnapKV(Policy):
    """Attention from an observation window of the last prompt queries, pooled along the sequence.

    The statistic is the probability each slot receives from the last `observation_window`
    queries (summed, averaged over the group's heads), set once at prefill; scores are its 1-D
    max (or average) pooling of width `kernel_size` over neighbouring positions, so clusters
    survive rather than isolated tokens; the window itself is always kept (SnapKV's defaults:
    w=32, k=7, max pooling).
    """

    observation_window: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    description = "attention from the last 32 prompt queries, max-pooled (k=7); the window always kept"
    scorer = "window attention + pooling"
    paper = "SnapKV: LLM Knows What You are Looking for Before Generation (arXiv:2404.14469)"
    collect_prefill = "window"

    def __post_init__(self):
        self.recent_tokens = self.observation_window

    def score(self, inp: ScoreInput) -> torch.Tensor:
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d

        def pooled(by_position: torch.Tensor) -> torch.Tensor:  # [B, H, T]
            B, H, T = by_position.shape
            out = pool(by_position.reshape(B * H, 1, T), self.kernel_size, stride=1, padding=self.kernel_size // 2)
            return out.view(B, H, T)

        return in_position_space(pooled, inp.attention, inp.positions)


register_presets(SnapKV, "snapkv")
