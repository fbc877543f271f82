"""Turning a task sample into the token ids the model sees, in two parts.

The prompt is `context + "\n" + question + answer_prefix`, wrapped in the model's
chat template when it has one (the answer prefix goes after the assistant turn
opens). The two parts are tokenised separately so query-aware and
query-agnostic runs see exactly the same tokens.
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


def prompt_length(tokenizer):
    """The tasks' length-fitting callback for this tokenizer."""
    def count(sample: Sample) -> int:
        context_ids, question_ids = encode(tokenizer, sample)
        return len(context_ids) + len(question_ids)
    return count
