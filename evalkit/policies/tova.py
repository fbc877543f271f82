from dataclasses import dataclass

import torch

from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets
from evalkit.policies.selection import Granularity


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: keep what the latest query attends to most.

    The statistic is the last query's softmax probability per slot, averaged over the query
    heads of each KV head, replaced at every forward; decoding with eviction therefore drops,
    each step, the token the current query needs least. As published (paper, official code,
    kvpress) TOVA keeps one token set per layer from the attention averaged over all heads:
    that is `tova` = `tova_token`; `tova_head` is the per-KV-head variant. The newest token is
    always kept (`recent_tokens` 1), as kvpress's TOVAPress pads its score with max + 1; the
    paper's rule may drop it (`--policy-arg recent_tokens=0`).
    """

    granularity: Granularity = Granularity.TOKEN
    description = ("attention of the latest query, averaged over the query heads that share the set "
                   "(at token granularity all heads: one set per layer); one eviction per step")
    scorer = "last-query attention"
    paper = "Transformers are Multi-State RNNs (TOVA, arXiv:2401.06104)"
    kvpress = "TOVAPress (at token granularity)"
    differs = ("the newest token is always kept (recent_tokens=1, kvpress's TOVAPress); the paper may evict it "
               "when its own attention is the lowest (recent_tokens=0)")
    collect_prefill = collect_decode = "window"
    observation_window: int = arg(1, 1, PROMPT)
    recent_tokens: int = arg(1, 0, PROMPT)  # the newest token (kvpress pads its score with max + 1)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return inp.statistic


register_presets(TOVA, "tova", default=Granularity.TOKEN)
