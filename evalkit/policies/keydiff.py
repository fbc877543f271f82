from dataclasses import dataclass

import torch

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
        norms = torch.linalg.vector_norm(keys, dim=-1, keepdim=True)  # [B, H_kv, N, 1]
        return -_cosine_to(keys, norms, self.anchor(keys, norms, live))

    def anchor(self, keys: torch.Tensor, norms: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, 1, D] the mean of the head's live keys, each made unit length (F.normalize)."""
        unit = keys / norms.clamp_min(_NORMALIZE_EPS)
        return (unit * live).sum(2, keepdim=True) / live.sum(2, keepdim=True).clamp(min=1)


# F.normalize's and F.cosine_similarity's floors on a norm.
_NORMALIZE_EPS, _COSINE_EPS = 1e-12, 1e-8


def _cosine_to(keys: torch.Tensor, norms: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """F.cosine_similarity(keys, anchor, dim=-1) [B, H_kv, N], bit for bit on a CPU, with the keys' `norms` already
    known and the anchor [B, H_kv, 1, D] normalised once: the function itself broadcasts the anchor to every key and
    takes its norm N times, the larger part of a decode step's KeyDiff scoring
    (tests/test_policies.py::test_keydiff_scores_are_cosine_similarity_bit_for_bit)."""
    anchor_unit = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(_COSINE_EPS)
    return ((keys / norms.clamp_min(_COSINE_EPS)) * anchor_unit).sum(-1)


register_presets(KeyDiff, "keydiff")
