"""The multi-turn tasks: every turn's answer is in the context once, under the key its question names; the whole
conversation fits the length; bad settings are one line, before any model loads."""

import json
import re

import pytest

from conftest import needs_model_files
from evalkit.errors import EvalkitError
from evalkit.tasks.multiturn import MultiturnKv, MultiturnNiah

LENGTH = 1500


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def tokenizer():
    from transformers import AutoTokenizer

    from evalkit.assets import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def turns_of(sample):
    return [(sample.question, sample.references), *((t.question, t.references) for t in sample.followups)]


@pytest.mark.model  # tokenizer: the default model's tokenizer
@pytest.mark.parametrize("task", [MultiturnNiah(), MultiturnKv(), MultiturnKv(6)])
def test_every_turn_asks_a_key_whose_one_value_is_its_answer(tokenizer, task):
    from evalkit.prompt import prompt_length

    count = prompt_length(tokenizer)
    samples = task.samples(count, LENGTH, 5, seed=1)
    assert samples == task.samples(count, LENGTH, 5, seed=1)
    for sample in samples:
        asked = turns_of(sample)
        assert len(asked) == task.turns == sample.meta["turns"]
        keys = [re.search(r"for (\S+) mentioned|Key: \"(\S+)\"", question).group(1, 2) for question, _ in asked]
        keys = [a or b for a, b in keys]
        assert keys == sample.meta["keys"] and len(set(keys)) == len(keys)
        for key, (_, (value,)) in zip(keys, asked):
            assert sample.context.count(value) == 1
            stored = (dict(json.loads(sample.context[sample.context.index("{"):]).items())[key]
                      if isinstance(task, MultiturnKv) else
                      re.search(rf"numbers for {re.escape(key)} is: (\d+)\.", sample.context).group(1))
            assert stored == value
        # The prompts and every answer's room fill the length, within a haystack unit.
        room = LENGTH - task.turns * task.max_new_tokens
        assert room - 80 <= count(sample) <= room
    # Turn order is not needle order: the first question is not always about the shallowest needle.
    assert len({min(range(task.turns), key=lambda i: s.meta["depths"][i]) for s in samples}) > 1


@pytest.mark.model  # tokenizer: the default model's tokenizer
def test_one_turn_is_a_single_question_sample(tokenizer):
    from evalkit.prompt import prompt_length

    (sample,) = MultiturnNiah().with_args({"turns": "1"}).samples(prompt_length(tokenizer), LENGTH, 1, 0)
    assert sample.followups == () and len(sample.references) == 1


@pytest.mark.parametrize("args, message", [
    ({"turns": "0"}, "turns must be a whole number from 1 to 64, got '0'"),
    ({"turns": "many"}, "turns must be a whole number from 1 to 64, got 'many'"),
    ({"rounds": "3"}, "unknown ruler:multiturn_niah task-arg rounds; known: turns"),
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(EvalkitError, match=re.escape(message)):
        MultiturnNiah().with_args(args)


def test_a_length_without_room_for_the_answers_is_refused():
    with pytest.raises(EvalkitError, match=r"--length 900 leaves no room for a prompt: 20 turns take 960 new tokens"):
        MultiturnKv(20).check_length(900)
