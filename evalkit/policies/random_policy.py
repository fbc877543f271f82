from dataclasses import dataclass

import torch

from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES


@dataclass
class RandomPolicy(Policy):
    """The floor every real scorer must beat: a random priority per (layer, head, position)."""

    description = "keeps random tokens: the floor any scorer must beat"
    scorer = "random priority"
    kvpress = "RandomPress"
    not_static = "its priorities are drawn on the host's generator as positions grow"

    def score(self, inp: ScoreInput) -> torch.Tensor:
        B, H, _ = inp.positions.shape
        span = int(inp.positions.max()) + 1
        generator = torch.Generator().manual_seed(inp.seed * 100_003 + inp.layer)
        # Drawn position-major so a token keeps its priority as the sequence grows, and the same for
        # every sequence of a batch, so a sample's tokens do not depend on its batch.
        priority = torch.rand(span, H, generator=generator).T.to(inp.positions.device)  # [H, span]
        return priority.expand(B, H, span).gather(2, inp.positions.clamp(min=0))


POLICIES.register("random", lambda: RandomPolicy(name="random"))
