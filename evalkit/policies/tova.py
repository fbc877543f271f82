from dataclasses import dataclass

import torch

from evalkit.policies.base import PROMPT, Policy, ScoreInput, arg, register_presets
from evalkit.policies.selection import Granularity


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: keep what the latest query attends to most.

    The statistic is the last query's softmax probability per slot, averaged over the query
    heads of each KV head, replaced at every forward; decoding with eviction therefore drops,
    each step, the token the current query needs least. As published (paper, official code,
    kvpress) TOVA keeps one token set per layer from the attention averaged over all heads:
    that is `tova` = `tova_token`; `tova_head` is the per-KV-head variant.
    """

    granularity: Granularity = Granularity.TOKEN
    description = ("attention of the latest query, averaged over the query heads that share the set "
                   "(at token granularity all heads: one set per layer); one eviction per step")
    scorer = "last-query attention"
    paper = "Transformers are Multi-State RNNs (TOVA, arXiv:2401.06104)"
    collect_prefill = collect_decode = "window"
    observation_window: int = arg(1, 1, PROMPT)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return inp.attention


register_presets(TOVA, "tova", default=Granularity.TOKEN)
