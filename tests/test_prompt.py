"""The prompt's split into what compression may see before the question, and the rest."""

import pytest

from evalkit.prompt import encode
from evalkit.tasks import Sample


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
