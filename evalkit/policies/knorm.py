from dataclasses import dataclass

import torch

from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets


@dataclass
class KeyNorm(Policy):
    """Keep the keys of lowest L2 norm: they draw the most attention (Devoto et al.); needs no attention."""

    description = "keeps the keys of lowest L2 norm; needs no attention statistics"
    scorer = "negative key L2 norm"
    paper = "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (arXiv:2406.11430)"
    kvpress = "KnormPress"

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return -inp.key_norms  # float64, computed once per stored key


register_presets(KeyNorm, "knorm")
