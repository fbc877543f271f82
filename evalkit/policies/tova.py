from dataclasses import dataclass

import torch

from evalkit.policies.base import Policy, ScoreInput, register_presets


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: keep what the latest query attends to most.

    The statistic is the last query's softmax probability per slot, averaged over the query
    heads of each KV head (TOVA's definition), replaced at every forward; decoding with
    eviction therefore drops, each step, the token the current query needs least.
    """

    description = "attention of the latest query (averaged over the group's heads); one eviction per step"
    scorer = "last-query attention"
    paper = "Transformers are Multi-State RNNs (TOVA, arXiv:2401.06104)"
    collect_prefill = collect_decode = "window"
    observation_window: int = 1

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return inp.attention


register_presets(TOVA, "tova")
