"""Turning a task sample into the token ids the model sees, in two parts.

The prompt is `context + "\n" + question + answer_prefix`, wrapped in the model's
chat template when it has one (the answer prefix goes after the assistant turn
opens). The two parts are tokenised separately so query-aware and
query-agnostic runs see exactly the same tokens. A multi-turn sample's later
questions come as the template writes a conversation (`encode_conversation`).
"""

from __future__ import annotations

from evalkit.tasks import Sample


def encode(tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the question ids include the answer prefix and template tail."""
    tail = "\n" + sample.question
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": sample.context + tail}],
                                             add_generation_prompt=True, tokenize=False)
        text += sample.answer_prefix
        # Anchored on the context: a bare "\n" (empty question) also occurs in the template's own tail.
        split = text.rindex(sample.context + tail) + len(sample.context)
        context_ids = tokenizer(text[:split], add_special_tokens=False).input_ids
    else:
        text = sample.context + tail + sample.answer_prefix
        split = len(sample.context)
        context_ids = tokenizer(text[:split]).input_ids
    question_ids = tokenizer(text[split:], add_special_tokens=False).input_ids
    return context_ids, question_ids


def encode_conversation(tokenizer, sample: Sample) -> tuple[list[int], list[list[int]]]:
    """(context ids, each turn's prompt ids): the first turn's are `encode`'s question ids, a later turn's close
    the previous answer as the chat template does, then ask its question and open the answer (prefix included).
    Answers are not here: they are the model's own, fed back as generated (`loop.conversation`)."""
    context_ids, first = encode(tokenizer, sample)
    return context_ids, [first, *(tokenizer(text, add_special_tokens=False).input_ids
                                  for text in _later_turns(tokenizer, sample))]


def _later_turns(tokenizer, sample: Sample) -> list[str]:
    """The text of each follow-up's prompt: what the template puts between an answer and the next answer."""
    if not tokenizer.chat_template or not sample.followups:
        return ["\n" + turn.question + turn.answer_prefix for turn in sample.followups]
    answers = [f"<<evalkit answer {i}>>" for i in range(len(sample.followups))]  # markers cut out below
    messages = [{"role": "user", "content": sample.context + "\n" + sample.question}]
    for answer, turn in zip(answers, sample.followups):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turn.question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ends = [text.index(answer) + len(answer) for answer in answers]
    starts = [text.index(answer) for answer in answers[1:]] + [len(text)]
    return [text[end:begin] + turn.answer_prefix for end, begin, turn in zip(ends, starts, sample.followups)]


def prompt_length(tokenizer):
    """The tasks' length-fitting callback for this tokenizer: every turn's prompt (answers excluded)."""
    def count(sample: Sample) -> int:
        context_ids, turns = encode_conversation(tokenizer, sample)
        return len(context_ids) + sum(map(len, turns))
    return count
