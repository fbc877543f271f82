"""One prefill of a batch's prompts, shared by every (policy, budget) cell of a sweep.

In full-prefill mode the prompt's forward pass does not depend on the policy (a layer's first
tokens attend to themselves the same way whatever the storage or statistic:
`evalkit.attention.prompt_attention`), so `share_prefill` runs it once, recording each layer's K/V
and every statistic the cells need, and `generate.generate(..., shared=)` stores them in each
cell's own cache exactly as its own forward would have (`SharedPrefill.fork_into`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from evalkit.attention import PromptRecord, evalkit_attention, store_statistic
from evalkit.generate import GenerationSettings, Request, left_padded, split_prompts, LoopState, forward
from evalkit.policies import Policy, make_policy


def statistic_key(policy: Policy, collect: str | None) -> tuple[str, int] | None:
    """How a shared prefill names the statistic `collect` of `policy`: (collect, its window or 0)."""
    if collect is None:
        return None
    return collect, policy.observation_window if collect == "window" else 0


@dataclass
class SharedPrefill:
    """One full prefill of a batch's compressed prompts, forked into any number of (policy, budget) cells."""

    compressed: list[list[int]]  # the prompts prefilled, as `split_prompts` gives them
    record: PromptRecord
    logits: torch.Tensor  # [B, V] float32 after each prompt's last token
    seconds: float

    def fork_into(self, state: LoopState) -> torch.Tensor:
        """Store the prefill in `state`'s empty cache with the statistic `state.collect`; the last logits."""
        key = statistic_key(state.policy, state.collect)
        if key is not None and key not in self.record.statistics:
            raise ValueError(f"the shared prefill recorded {self.record.statistics}, not {key}")
        _, valid, positions = left_padded(self.compressed, state.seen)
        device = state.model.device
        valid, positions = valid.to(device), positions.to(device)
        for layer_idx, layer in enumerate(state.cache.layers):
            k, v, stats = self.record.layers[layer_idx]
            slots = layer.append(k, v, positions, valid)
            if key is not None:
                store_statistic(layer, slots, state.collect, stats[key], valid)
        counts = valid.sum(1).cpu()
        state.seen += counts
        if state.collect is not None:
            state.stat_end = torch.where(counts > 0, state.seen, state.stat_end)
        if state.observe:
            state.observe("forward", state.cache)
        return self.logits.clone()


@torch.inference_mode()
def share_prefill(model, requests: list[Request], query_aware: bool,
                  statistics: set[tuple[str, int]]) -> SharedPrefill:
    """The full prefill of `requests`' compressed prompts, once, with every statistic in `statistics`."""
    compressed, _ = split_prompts(requests, query_aware)
    settings = GenerationSettings(policy=make_policy("full"))
    start = torch.zeros(len(requests), dtype=torch.long)
    state = LoopState(model, None, settings.policy, settings, start, start.clone(),
                   record=PromptRecord(sorted(statistics)))
    began = time.perf_counter()
    with evalkit_attention(model):
        logits, _ = forward(state, compressed)
    return SharedPrefill(compressed, state.record, logits, time.perf_counter() - began)
