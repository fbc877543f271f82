"""The first two moments of a layer's prompt queries before RoPE: what Expected Attention reads.

The attention function sees queries after RoPE; `add` turns them back (RoPE is a rotation by the
position's angles, times the rope's attention scaling) and sums them, and their outer products, in
float64 per (sequence, query head). Queries at positions below `skip` are left out (kvpress drops the
first n_sink hidden states: sinks' queries are outliers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's RoPE pairing: [x1, x2] -> [-x2, x1] over the halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The query before RoPE: q = s R(θ) x with cos = s cos θ, sin = s sin θ, so x = (q cos - rot(q) sin) / s²."""
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


@dataclass
class QueryMoments:
    """Per layer: sum [B, H_q, D] and outer-product sum [B, H_q, D, D] (float64) of the pre-RoPE queries at
    positions >= `skip`, their count [B], and `end` [B], the tokens seen when they were last added."""

    skip: int
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    outer: dict[int, torch.Tensor] = field(default_factory=dict)
    count: dict[int, torch.Tensor] = field(default_factory=dict)
    end: torch.Tensor | None = None

    def add(self, layer: int, query: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
        """query [B, H_q, T, D] after RoPE; positions, valid [B, T]; cos, sin [B, T, D] of those positions."""
        x = unrotate(query.double(), cos[:, None].double(), sin[:, None].double())  # [B, H_q, T, D]
        counted = (valid & (positions >= self.skip)).double()  # [B, T]
        x = x * counted[:, None, :, None]
        sums, outer = x.sum(2), torch.matmul(x.transpose(-1, -2), x)
        if layer in self.sums:
            sums, outer = sums + self.sums[layer], outer + self.outer[layer]
            counted = counted.sum(1) + self.count[layer]
        else:
            counted = counted.sum(1)
        self.sums[layer], self.outer[layer], self.count[layer] = sums, outer, counted
        if layer == 0:
            last = torch.where(valid, positions + 1, 0).amax(1).cpu()
            self.end = last if self.end is None else torch.maximum(self.end, last)

    def mean_and_covariance(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """mean [B, H_q, D] and population covariance [B, H_q, D, D] (float64) of the layer's queries."""
        n = self.count[layer].clamp(min=1)[:, None, None]
        mean = self.sums[layer] / n
        covariance = self.outer[layer] / n[..., None] - mean[..., :, None] * mean[..., None, :]
        return mean, covariance
