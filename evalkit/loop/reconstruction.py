"""KVzip's context reconstruction (`Policy.reconstructs`): after the prompt's prefill the model repeats its
context, chunk by chunk, on top of the cache; each chunk token's score is the most attention a
reconstruction query gives it (`reconstruction_ops.reconstruction_attention`, in the same pass as the
forward's attention). The reconstruction tokens are never stored: the cache holds the prompt alone, every
token scored.
"""

from __future__ import annotations

import time

import torch

from evalkit.attention import ForwardPlan, ReconstructionChunk
from evalkit.loop.state import LoopState, ReconstructionPrompts, left_padded

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8  # tokens of the previous chunk that a later chunk's prompt starts from


def reconstruction_prompts(tokenizer) -> ReconstructionPrompts:
    """KVzip's prompts in this tokenizer: the chat template's part before the user's text is not repeated,
    its assistant turn opens the repetition ("\\n" without a template). Without a tokenizer (the loop's
    token-level API, as the tests drive it) there are no words to ask with: each chunk is fed again alone."""
    if tokenizer is None:
        return ReconstructionPrompts(0, [], [], [])
    prefix, suffix = "", "\n"
    if tokenizer.chat_template:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        before, suffix = text.split(separator)
        prefix = before.split(dummy)[0]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return ReconstructionPrompts(len(ids(prefix)), ids(FIRST), ids(LATER), ids(suffix))


def reconstruction_tokens(prompts: ReconstructionPrompts, compressed: list[list[int]], chunk_size: int,
                          begin: int = 0, end: int | None = None):
    """Per chunk of positions [begin, end) of the prompts (past the template's prefix): each sequence's
    reconstruction tokens and its chunk's (first, end) positions ((0, 0): none)."""
    begin = max(begin, prompts.prefix_length)
    longest = max(len(ids) for ids in compressed)
    stop = longest if end is None else min(end, longest)
    for first in range(begin, stop, chunk_size):
        tokens, spans = [], []
        for ids in compressed:
            piece = ids[first:min(first + chunk_size, stop)]
            ask = prompts.first if first == prompts.prefix_length else \
                prompts.later + ids[max(prompts.prefix_length, first - PREVIOUS_TAIL):first]
            tokens.append(ask + prompts.suffix + piece if piece else [])
            spans.append((first, first + len(piece)) if piece else (0, 0))
        yield tokens, torch.tensor(spans)


def reconstruct(state: LoopState, compressed: list[list[int]], begin: int = 0, end: int | None = None) -> None:
    """Score the prompt tokens at positions [begin, end) in `state`'s cache by context reconstruction (a chunked
    prefill reconstructs each prefill chunk once it is fed). Only statistics change: the reconstruction tokens
    are never stored, and the cache has seen what it had."""
    begun = time.perf_counter()
    device = state.model.device
    for tokens, spans in reconstruction_tokens(state.reconstruction, compressed, state.policy.chunk_size, begin, end):
        ids, valid, positions = left_padded(tokens, state.seen)
        plan = ForwardPlan(state.cache, positions.to(device), valid.to(device), kernels=state.settings.kernels,
                           reconstruction=ReconstructionChunk(spans.to(device), state.policy.sink_tokens))
        state.model(input_ids=ids.to(device), position_ids=plan.positions, use_cache=False, logits_to_keep=1,
                    evalkit_plan=plan)
    state.stat_end = state.seen.clone()
    state.reconstruction_seconds += time.perf_counter() - begun
