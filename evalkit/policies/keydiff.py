from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets


@dataclass
class KeyDiff(Policy):
    """Keep the keys least like the head's average key: the score is minus the cosine similarity of each
    key with the mean of the head's unit-normalised keys (the live ones), as kvpress's KeyDiffPress.
    Needs no attention. The paper evicts block by block as the prompt streams in; kvpress scores the
    whole prompt at once, and so does evalkit (decode eviction re-scores the keys held, a block of one).
    """

    description = "keeps the keys least similar (cosine) to the head's mean key; needs no attention"
    scorer = "negative cosine similarity to the mean key"
    paper = "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference (arXiv:2504.15364)"
    kvpress = "KeyDiffPress"
    differs = "scores the whole prompt at once as kvpress's KeyDiffPress, not block by block as the paper"

    def score(self, inp: ScoreInput) -> torch.Tensor:
        live = (inp.positions >= 0)[..., None]  # [B, H_kv, N, 1]
        keys = inp.keys.float()
        unit = F.normalize(keys, p=2, dim=-1) * live
        anchor = unit.sum(2, keepdim=True) / live.sum(2, keepdim=True).clamp(min=1)  # [B, H_kv, 1, D]
        return -F.cosine_similarity(keys, anchor, dim=-1)


register_presets(KeyDiff, "keydiff")
