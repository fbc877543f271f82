"""The prompt's split into what compression may see before the question, and the rest; a conversation's turns."""

import copy

import pytest

from evalkit.prompt import encode, encode_conversation
from evalkit.tasks import Sample, Turn

pytestmark = pytest.mark.model  # every test takes the default model's tokenizer (default_model)


@pytest.mark.parametrize("question, prefix", [
    ("What is the code?", " The code is"),
    ("", " The code is"),  # RULER-format data: the question lives inside the context
    ("What is the code?", " Answer:\nThe code is"),  # a newline inside the answer prefix
])
def test_the_context_part_ends_with_the_context(default_model, question, prefix):
    _, tokenizer = default_model
    sample = Sample("s", "Some words.\nThe code is 4817.", question, prefix, ["4817"], 8)
    context_ids, question_ids = encode(tokenizer, sample)
    context = tokenizer.decode(context_ids)
    rest = tokenizer.decode(question_ids)
    assert context.endswith(sample.context)  # the template's tail is never compressed as context
    assert rest.startswith("\n" + question) and rest.endswith(prefix)


def test_a_conversation_is_the_chat_templates_conversation_with_the_models_answers(default_model):
    _, tokenizer = default_model
    sample = Sample("s", "Some words.\nThe code is 4817.", "What is the code?", " The code is", ["4817"], 8,
                    followups=(Turn("And the colour?", " The colour is", ["red"]), Turn("Why?", "", ["because"])))
    context_ids, turns = encode_conversation(tokenizer, sample)
    assert (context_ids, turns[0]) == encode(tokenizer, sample)  # the first turn is the single-question prompt
    answers = [" 4817.", " red.", " Because."]
    ids = list(context_ids)
    for turn, answer in zip(turns, answers):
        ids += turn + tokenizer(answer, add_special_tokens=False).input_ids
    questions = [sample.context + "\n" + sample.question, *(t.question for t in sample.followups)]
    prefixes = [sample.answer_prefix, *(t.answer_prefix for t in sample.followups)]
    messages = [message for question, prefix, answer in zip(questions, prefixes, answers)
                for message in ({"role": "user", "content": question}, {"role": "assistant", "content": prefix + answer})]
    # The template closes the last answer too; the conversation stops where the model would.
    expected = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids) + "<|im_end|>\n" == expected


def test_without_a_chat_template_turns_follow_each_other_on_new_lines(default_model):
    _, tokenizer = default_model
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    sample = Sample("s", "Context.", "Q1?", " A1:", ["x"], 8, followups=(Turn("Q2?", " A2:", ["y"]),))
    context_ids, turns = encode_conversation(plain, sample)
    assert plain.decode(context_ids + turns[0] + turns[1]) == "Context.\nQ1? A1:\nQ2? A2:"
