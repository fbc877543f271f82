from dataclasses import dataclass

import torch

from evalkit.policies.base import register_presets
from evalkit.policies.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's scores, with budgets that shrink linearly from the first layer to the last.

    PyramidKV's allocation: the last layer keeps budget / beta tokens, the first
    2 * budget - budget / beta, the layers between on a straight line, so the total over
    layers is what a uniform budget would keep (beta = 20 as in the paper).
    """

    beta: float = 20.0
    description = "SnapKV scores; per-layer budgets decreasing linearly (pyramid), same total"
    scorer = "window attention + pooling, pyramid budgets"
    paper = "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv:2406.02069)"

    def layer_budgets(self, budget: torch.Tensor, num_layers: int) -> torch.Tensor:
        if num_layers == 1:
            return budget[None]
        low = budget.double() / self.beta
        high = 2 * budget.double() - low
        step = torch.arange(num_layers, dtype=torch.float64)[:, None] / (num_layers - 1)
        return torch.round(high - (high - low) * step).long().clamp(min=1)  # [L, B]


register_presets(PyramidKV, "pyramidkv")
