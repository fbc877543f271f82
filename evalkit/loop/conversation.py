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
from evalkit.loop.joint_decode import branch_groups, model_rows_apart, step_together
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
    return converse_branches(model, tokenizer, conversation, [settings], shared)[0]


@torch.inference_mode()
def converse_branches(model, tokenizer, conversation: Conversation, branches: list[GenerationSettings],
                      shared: SharedPrefill | None = None) -> list[list[Generation]]:
    """`converse` under every settings in `branches` (one shared prefill's branches), the same generations: each
    step of the answers being decoded goes through one forward for all branches (`joint_decode`), a turn's prompt
    through its branch's own; as many branches at a time as their caches fit (`joint_decode.branch_groups`)."""
    first, *later = conversation.turns
    request = Request(conversation.context_ids, first, conversation.max_new_tokens, conversation.stop)
    generations: list[list[Generation]] = []
    joint_possible = len(branches) > 1 and model_rows_apart(model, 1)  # the probe runs the model's own attention

    def opened(settings: GenerationSettings) -> _Talk:
        run = start(model, tokenizer, [request], settings, shared=shared, later_turns=tuple(len(t) + 1 for t in later))
        return _Talk(run, list(later), conversation)

    with evalkit_attention(model):
        for group in branch_groups(model, branches, opened):
            generations += _talk_together(group, joint_possible)
    return generations


class _Talk:
    """One branch's conversation: its current turn's Decoding, the turns still to ask, the answers so far."""

    def __init__(self, run: Decoding, later: list[list[int]], conversation: Conversation):
        self.run, self.later, self.conversation = run, later, conversation
        self.generations: list[Generation] = []
        self.fed = int(run.state.seen[0])  # tokens fed when this turn's answer began
        self.seconds = 0.0  # this turn's decoding so far

    @property
    def state(self):
        return self.run.state

    def answered(self) -> bool:
        """The answer just ended: keep it, and ask the next turn's question if there is one (False: none left)."""
        run = self.run
        self.generations += run.generations(self.seconds)
        if not self.later:
            return False
        turn = self.later.pop(0)
        unfed = run.outputs[0][int(run.state.seen[0]) - self.fed:]  # its last token, unless it ended on EOS
        begun = time.perf_counter()
        logits, _ = forward(run.state, [unfed + turn])
        run.advance(logits)
        self.run = _next_turn(run, Request([], turn, self.conversation.max_new_tokens, self.conversation.stop),
                              time.perf_counter() - begun)
        self.fed, self.seconds = int(run.state.seen[0]), 0.0
        return True


def _talk_together(talks: list[_Talk], joint_possible: bool) -> list[list[Generation]]:
    """Every talk to its last answer; the decode steps of those answering go through one forward (each its own
    where the probes say joint rows would differ, `joint_decode`)."""
    active = list(talks)
    while active:
        stepping, tokens = [], []
        for talk in active:
            begun = time.perf_counter()
            chosen = talk.run.next_tokens()
            talk.seconds += time.perf_counter() - begun
            if chosen is not None:
                stepping.append(talk), tokens.append(chosen)
        active = [talk for talk in active if talk in stepping or talk.answered()]
        for talk, step_seconds in zip(stepping, step_together([talk.run for talk in stepping], tokens, joint_possible,
                                                              1)):
            talk.seconds += step_seconds
    return [talk.generations for talk in talks]


def _next_turn(run: Decoding, request: Request, prompt_seconds: float) -> Decoding:
    """A Decoding of the same state for the next turn, whose prompt was just fed; what decoding read is counted
    from zero (Quest's attended fraction is a turn's own)."""
    state = run.state
    if state.attended is not None:
        state.attended.zero_()
        state.available.zero_()
    return Decoding(state, [request], run.tokenizer, run.logits, run.caps, run.evict, state.seen.clone(),
                    prompt_seconds)
