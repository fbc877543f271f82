from dataclasses import dataclass

import torch

from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES


@dataclass
class StreamingLLM(Policy):
    """Attention sinks plus a recent window (Xiao et al., 2023): the budget is all sinks and window."""

    sink_tokens: int = arg(4, 0, PROMPT)
    recent_fraction: float = arg(1.0, 0.0, 1.0)
    description = "first 4 tokens (attention sinks) + a recent window filling the rest of the budget"
    scorer = "position only"
    paper = "Efficient Streaming Language Models with Attention Sinks (arXiv:2309.17453)"
    kvpress = "StreamingLLMPress"

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return torch.zeros_like(inp.statistic)


POLICIES.register("streaming_llm", lambda: StreamingLLM(name="streaming_llm"))
