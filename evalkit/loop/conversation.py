"""Several questions on one compressed context (`converse`): the context is prefilled and compressed once, then
turn after turn is appended onto the same cache: a question, the model's own answer, the next question, ...

A turn's prompt is what comes before its answer: for the first, the question and answer prefix (exactly a
single-question run's, so the first turn is that run); for a later one, the chat template's end of the previous
answer, the question and the answer prefix (`prompt.encode_conversation`). An answer is fed back as generated,
its end-of-sequence token left to the next turn's prompt, which closes it. With decode eviction the cache stays
at the size it had when the first answer began (the budget plus the first question), evicting among everything
it holds, earlier turns included; without it only the context was ever compressed and every turn stays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from evalkit.attention import evalkit_attention
from evalkit.loop.generate import Decoding, start
from evalkit.loop.shared_prefill import SharedPrefill
from evalkit.loop.state import Generation, GenerationSettings, Request, forward


@dataclass
class Conversation:
    context_ids: list[int]
    turns: list[list[int]]  # each turn's prompt tokens, before its answer
    max_new_tokens: int  # per answer
    stop: tuple[str, ...] = ()


@torch.inference_mode()
def converse(model, tokenizer, conversation: Conversation, settings: GenerationSettings,
             shared: SharedPrefill | None = None) -> list[Generation]:
    """A Generation per turn: its answer, and the cache as it stood when the answer began (`prompt_tokens`: every
    token fed so far). With `shared`, the first turn's prefill comes from a prefill shared with other runs."""
    first, *later = conversation.turns
    request = Request(conversation.context_ids, first, conversation.max_new_tokens, conversation.stop)
    generations: list[Generation] = []
    with evalkit_attention(model):
        run = start(model, tokenizer, [request], settings, shared=shared, later_turns=tuple(len(t) + 1 for t in later))
        for turn in [*later, None]:
            fed = int(run.state.seen[0])
            begun = time.perf_counter()
            while (tokens := run.next_tokens()) is not None:
                run.feed(tokens)
            generations += run.generations(time.perf_counter() - begun)
            if turn is None:
                return generations
            unfed = run.outputs[0][int(run.state.seen[0]) - fed:]  # its last token, unless it ended on EOS
            begun = time.perf_counter()
            logits, _ = forward(run.state, [unfed + turn])
            run.advance(logits)
            run = _next_turn(run, Request([], turn, conversation.max_new_tokens, conversation.stop),
                             time.perf_counter() - begun)


def _next_turn(run: Decoding, request: Request, prompt_seconds: float) -> Decoding:
    """A Decoding of the same state for the next turn, whose prompt was just fed; what decoding read is counted
    from zero (Quest's attended fraction is a turn's own)."""
    state = run.state
    if state.attended is not None:
        state.attended.zero_()
        state.available.zero_()
    return Decoding(state, [request], run.tokenizer, run.logits, run.caps, run.evict, state.seen.clone(),
                    prompt_seconds)
