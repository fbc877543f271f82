from dataclasses import dataclass

import torch

from evalkit.policies.base import Policy, ScoreInput, register_presets


@dataclass
class KeyNorm(Policy):
    """Keep the keys of lowest L2 norm: they draw the most attention (Devoto et al.); needs no attention."""

    description = "keeps the keys of lowest L2 norm; needs no attention statistics"
    scorer = "negative key L2 norm"
    paper = "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (arXiv:2406.11430)"
    reads_keys = True

    def score(self, inp: ScoreInput) -> torch.Tensor:
        # float64, not float32: a cast to float32 would order near-equal norms by rounding noise
        return -inp.keys.double().norm(dim=-1)


register_presets(KeyNorm, "knorm")
