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
        """-F.cosine_similarity(keys, anchor) with anchor the mean of F.normalize(keys) over the live slots, bit for
        bit, in half the time: decode eviction scores every held key each step, and torch's cosine broadcasts the
        anchor to every key (its norm and quotient worked out N times) and normalises the keys again."""
        live = inp.positions >= 0  # [B, H_kv, N]
        keys = inp.keys.float()
        static = inp.span is not None  # a static decode step reads nothing back to the host
        norms = torch.linalg.vector_norm(keys, dim=-1, keepdim=True)  # [B, H_kv, N, 1]
        unit = keys / norms.clamp_min(_NORMALIZE_EPS)  # F.normalize's
        held = unit * live[..., None] if static or not bool(live.all()) else unit
        anchor = held.sum(2, keepdim=True) / live.sum(2)[..., None, None].clamp(min=1)  # [B, H_kv, 1, D]
        # the cosine's own quotients: the keys' differ from `unit` only for norms under its eps
        toward = keys / norms.clamp_min(_COSINE_EPS) if static or bool((norms < _COSINE_EPS).any()) else unit
        toward = toward.mul_(anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(_COSINE_EPS))
        return -toward.sum(-1)  # in place: `toward` is this call's own, and one [B, H_kv, N, D] fewer to allocate


_NORMALIZE_EPS, _COSINE_EPS = 1e-12, 1e-8  # F.normalize's and F.cosine_similarity's defaults


register_presets(KeyDiff, "keydiff")
