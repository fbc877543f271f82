from dataclasses import dataclass

import torch

from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES


@dataclass
class Full(Policy):
    """The reference: every token stays, whatever the budget."""

    description = "no eviction: the full cache every other policy is compared with"
    scorer = "-"
    kvpress = "no press"
    evicts = False

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return torch.zeros_like(inp.statistic)


POLICIES.register("full", lambda: Full(name="full"))
