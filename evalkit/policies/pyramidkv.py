from dataclasses import dataclass

import torch

from evalkit.policies.arguments import arg
from evalkit.policies.names import register_presets
from evalkit.policies.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's scores, with per-layer budgets that shrink linearly from the first layer to the last.

    KVCache-Factory's schedule: the window w sits on top of a pyramid of selected tokens. With
    m = budget - w selected per layer on average, the last layer selects lo = m // beta, the first
    hi = 2m - lo (clamped to the prefix, n - w, with lo = 2m - hi so the mean stays m), the
    layers between on a straight line. Rounded by largest remainders so the layers select
    exactly L * m in all: the same total as a uniform budget. A budget not above the window
    is plain SnapKV, as kvpress falls back (beta = 20 as in the paper).
    """

    beta: float = arg(20.0, 1.0, 1e6)
    description = "SnapKV scores; per-layer budgets on a linear pyramid above the window, same total"
    scorer = "window attention + pooling, pyramid budgets"
    paper = "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv:2406.02069)"
    kvpress = "PyramidKVPress"
    differs = ("layer budgets rounded by largest remainders so the total equals the uniform one exactly "
               "(KVCache-Factory floors the step and keeps a few % more)")

    def layer_caps(self, tokens: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
        w = self.observation_window
        selected = (tokens - w).double()  # [B] m
        if num_layers == 1:
            return tokens[None]
        lo = torch.floor(selected / self.beta)
        hi = 2 * selected - lo
        prefix = (lengths - w).double()
        clamp = hi > prefix
        hi = torch.where(clamp, prefix, hi)
        lo = torch.where(clamp, 2 * selected - hi, lo)
        step = torch.arange(num_layers, dtype=torch.float64)[:, None] / (num_layers - 1)  # [L, 1]
        exact = hi - (hi - lo) * step  # [L, B], sums to L * m
        floor = torch.floor(exact)
        short = (num_layers * selected - floor.sum(0)).round().long()  # [B] layers that get one more
        by_fraction = torch.argsort(-(exact - floor), dim=0, stable=True)
        rank = torch.empty_like(by_fraction).scatter_(0, by_fraction, torch.arange(num_layers)[:, None].expand_as(by_fraction))
        pyramid = floor.long() + (rank < short).long() + w
        return torch.where(selected > 0, pyramid, tokens.expand(num_layers, -1))  # [L, B]


register_presets(PyramidKV, "pyramidkv")
