import functools
import random
import re

import pytest

from conftest import needs_model_files
from evalkit.assets import default_model_dir
from evalkit.errors import EvalkitError
from evalkit.tasks import TASKS, Sample
from evalkit.tasks.haystack import essay_words, split_sentences
from evalkit.tasks.long_answer import ReciteList, RecitePassage
from evalkit.tasks.metrics import (METRICS, edit_similarity, lines_in_order, sentences_in_order,
                                   units_before_first_error)

NAMES = ("long:recite_list", "long:recite_passage")


def words(sample: Sample) -> int:
    """A stand-in tokenizer for tests that need none: one token a word."""
    return len((sample.context + "\n" + sample.question + sample.answer_prefix).split())


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def prompt_length():
    from transformers import AutoTokenizer

    from evalkit.prompt import prompt_length

    return prompt_length(AutoTokenizer.from_pretrained(str(default_model_dir())))


def block(sample: Sample, tag: str) -> str:
    """The marked block of a sample's context, read back from the text."""
    (body,) = re.findall(rf"\n<{tag}>\n(.*?)\n</{tag}>", sample.context, flags=re.DOTALL)
    return body


# --- metrics ---------------------------------------------------------------------------------

REFERENCES = ["apple: 1234567", "river: 7654321", "stone: 1111111", "cloud: 2222222"]


def test_lines_in_order_by_hand():
    assert lines_in_order("\n".join(REFERENCES), REFERENCES) == 1.0
    assert lines_in_order(" apple:  1234567 \n\nriver: 7654321\nstone: 1111111\ncloud: 2222222\n", REFERENCES) == 1.0
    dropped = [REFERENCES[0], REFERENCES[1], REFERENCES[3]]
    assert lines_in_order("\n".join(dropped), REFERENCES) == 0.75
    swapped = [REFERENCES[0], REFERENCES[2], REFERENCES[1], REFERENCES[3]]
    assert lines_in_order("\n".join(swapped), REFERENCES) == 0.75  # one of the two swapped lines is out of order
    looping = [REFERENCES[0], REFERENCES[1]] + [REFERENCES[1]] * 20
    assert lines_in_order("\n".join(looping), REFERENCES) == 0.5  # a repeat counts once
    assert lines_in_order("apple: 1234568\nriver: 7654321", REFERENCES) == 0.25  # one wrong digit loses the line
    assert lines_in_order("", REFERENCES) == 0.0


def test_edit_similarity_by_hand():
    assert edit_similarity("\n".join(REFERENCES), REFERENCES) == 1.0
    # 8 reference words; a dropped line is 2 deletions, a swap 4 substitutions, one wrong digit 1
    assert edit_similarity("\n".join([REFERENCES[0], REFERENCES[1], REFERENCES[3]]), REFERENCES) == 0.75
    assert edit_similarity("\n".join([REFERENCES[0], REFERENCES[2], REFERENCES[1], REFERENCES[3]]), REFERENCES) == 0.5
    assert edit_similarity("apple: 1234568 river: 7654321 stone: 1111111 cloud: 2222222", REFERENCES) == 0.875
    # the loop's 40 extra words are charged: 2 lines right, 2 missing (4 edits) among 44 words
    looping = [REFERENCES[0], REFERENCES[1]] + [REFERENCES[1]] * 20
    assert edit_similarity("\n".join(looping), REFERENCES) == pytest.approx(1 - 40 / 44)
    assert edit_similarity("", REFERENCES) == 0.0
    assert edit_similarity("", [""]) == 1.0


def test_sentences_in_order_by_hand():
    references = ["It rained all day.", "Nobody came!", "Was it the weather?"]
    assert sentences_in_order("It rained all day. Nobody came! Was it the weather?", references) == 1.0
    assert sentences_in_order("It rained all day. Was it the weather?", references) == pytest.approx(2 / 3)
    assert sentences_in_order("Nobody came! It rained all day. Was it the weather?", references) == pytest.approx(2 / 3)
    assert sentences_in_order("It rained all day. It rained all day. It rained all day.", references) == pytest.approx(1 / 3)
    assert sentences_in_order("It rained all day long. Nobody came!", references) == pytest.approx(1 / 3)


def test_units_before_first_error_by_hand():
    assert units_before_first_error(REFERENCES, REFERENCES) == 4
    assert units_before_first_error([" apple:  1234567 ", "", "river: 7654321", "stone: 1111112"], REFERENCES) == 2
    assert units_before_first_error([REFERENCES[1], REFERENCES[0]], REFERENCES) == 0  # in place, not anywhere
    assert units_before_first_error(REFERENCES + ["extra: 3"], REFERENCES) == 4
    assert units_before_first_error([], REFERENCES) == 0
    task = ReciteList()
    looping = "\n".join([REFERENCES[0], REFERENCES[1], REFERENCES[1], REFERENCES[2], REFERENCES[3]])
    assert (task.recited_prefix(looping, REFERENCES), task.score(looping, REFERENCES)) == (2, 1.0)
    assert task.recited_prefix("\n".join(REFERENCES[:3]) + "\n</list>\n" + REFERENCES[3], REFERENCES) == 3
    assert RecitePassage().recited_prefix("It rained all day. Nobody came? </passage>",
                                          ["It rained all day.", "Nobody came!"]) == 1


def lcs(a, b):
    """The length of a longest common subsequence, by plain recursion."""
    @functools.lru_cache(maxsize=None)
    def go(i, j):
        if i == len(a) or j == len(b):
            return 0
        return go(i + 1, j + 1) + 1 if a[i] == b[j] else max(go(i + 1, j), go(i, j + 1))
    return go(0, 0)


def levenshtein(a, b):
    """Edit distance by plain recursion."""
    @functools.lru_cache(maxsize=None)
    def go(i, j):
        if i == len(a) or j == len(b):
            return len(a) - i + len(b) - j
        return min(go(i + 1, j) + 1, go(i, j + 1) + 1, go(i + 1, j + 1) + (a[i] != b[j]))
    return go(0, 0)


def test_metrics_equal_their_definitions_on_random_cases():
    rng = random.Random("long-answer-metrics")
    for _ in range(500):
        references = [rng.choice("abcd") for _ in range(rng.randint(1, 7))]
        predicted = [rng.choice("abcde") for _ in range(rng.randint(0, 9))]
        assert lines_in_order("\n".join(predicted), references) == lcs(tuple(predicted), tuple(references)) / len(references)
        longer = max(len(predicted), len(references))
        assert edit_similarity(" ".join(predicted), references) == pytest.approx(
            1 - levenshtein(tuple(predicted), tuple(references)) / longer)


def test_metrics_are_registered():
    assert {name: METRICS[name] for name in ("lines_in_order", "sentences_in_order", "edit_similarity")} == {
        "lines_in_order": lines_in_order, "sentences_in_order": sentences_in_order, "edit_similarity": edit_similarity}


# --- the tasks -------------------------------------------------------------------------------

def test_registered_under_long_names_and_aliases():
    assert type(TASKS.create("long:recite_list")) is type(TASKS.create("recite_list")) is ReciteList
    assert type(TASKS.create("long:recite_passage")) is type(TASKS.create("recite_passage")) is RecitePassage
    assert (ReciteList.metric, RecitePassage.metric) == ("lines_in_order", "sentences_in_order")


def test_a_task_scores_the_answer_up_to_its_closing_tag():
    task = ReciteList()
    answer = "\n".join(REFERENCES) + "\n</list>\nThat is the whole list, in order."
    assert task.score(answer, REFERENCES) == 1.0
    assert task.score_details(answer, REFERENCES) == {"edit_similarity": 1.0}
    assert task.score("\n".join(REFERENCES[:2]) + "\n</list>\n" + "\n".join(REFERENCES[2:]), REFERENCES) == 0.5
    assert RecitePassage().score("Nobody came! </passage> It rained all day.", ["It rained all day.", "Nobody came!"]) == 0.5


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_samples_without_global_random_state(name):
    task = TASKS.create(name)
    random.seed(1)
    state = random.getstate()
    first = task.samples(words, 1500, 3, seed=5)
    assert random.getstate() == state
    random.seed(2)
    assert task.samples(words, 1500, 3, seed=5) == first
    other = task.samples(words, 1500, 3, seed=6)
    assert {tuple(s.references) for s in other}.isdisjoint(tuple(s.references) for s in first)


def test_the_list_is_in_the_context_once_and_is_the_reference():
    samples = ReciteList().with_args({"entries": "12"}).samples(words, 1200, 3, seed=0)
    for sample in samples:
        lines = block(sample, "list").split("\n")
        assert lines == sample.references and len(lines) == 12
        keys, values = zip(*(re.fullmatch(r"([a-z]+): ([1-9]\d{6})", line).groups() for line in lines))
        assert len(set(keys)) == len(set(values)) == 12
        assert sample.context.count("<list>") == sample.context.count("</list>") == 2  # the instruction names both
        assert sample.context.startswith("Read the following text. A list of 12 entries")
        assert sample.answer_prefix == "<list>\n"
    assert samples[0].context.split("\n\n")[1].startswith("<list>")  # depth 0: the list comes first
    assert samples[-1].context.endswith("</list>")  # depth 100: last
    assert [s.meta["depth"] for s in samples] == [0, 50, 100]


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_the_passage_is_whole_sentences_found_once_and_is_the_reference(prompt_length):
    for sample in RecitePassage().samples(prompt_length, 2048, 3, seed=0):
        passage = block(sample, "passage")
        assert passage == " ".join(sample.references) and split_sentences(passage) == sample.references
        assert sample.context.count(passage) == 1  # the filler never holds it
        assert " ".join(essay_words()).count(passage) == 1 and passage[0].isupper() and passage[-1] in ".?!\"')"
        # the fewest sentences of at least 320 tokens
        empty = prompt_length(Sample("", "", "", "", [], 0))
        assert prompt_length(Sample("", passage, "", "", [], 0)) - empty >= 320
        assert prompt_length(Sample("", " ".join(sample.references[:-1]), "", "", [], 0)) - empty < 320


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_prompt_and_answer_fill_the_length_without_passing_it(prompt_length, name, length):
    for sample in TASKS.create(name).samples(prompt_length, length, 3, seed=0):
        assert 0.97 * length <= prompt_length(sample) + sample.max_new_tokens <= length


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", NAMES)
def test_new_tokens_hold_the_answer_with_room_to_spare(prompt_length, name):
    task = TASKS.create(name)
    for sample in task.samples(prompt_length, 2048, 2, seed=3):
        answer = task.joiner.join(sample.references) + f"\n</{task.tag}>"
        tokens = prompt_length(Sample("", answer, "", "", [], 0)) - prompt_length(Sample("", "", "", "", [], 0))
        assert sample.meta["answer_tokens"] == tokens and 300 <= tokens <= 500  # the defaults' answers
        assert sample.max_new_tokens == tokens + tokens // 8 + 16


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_the_size_args_set_the_answer(prompt_length):
    (short,) = ReciteList().with_args({"entries": "5"}).samples(prompt_length, 2048, 1, seed=0)
    (long,) = ReciteList().with_args({"entries": "80"}).samples(prompt_length, 4096, 1, seed=0)
    assert (len(short.references), len(long.references)) == (5, 80) and long.meta["answer_tokens"] > 900
    (passage,) = RecitePassage().with_args({"tokens": "600"}).samples(prompt_length, 2048, 1, seed=0)
    assert passage.meta["answer_tokens"] >= 600


@pytest.mark.parametrize("name, args, message", [
    ("long:recite_list", {"lines": "3"}, "unknown long:recite_list task-arg lines; known: entries"),
    ("long:recite_list", {"entries": "0"}, "entries must be a whole number from 1 to"),
    ("long:recite_list", {"entries": "ten"}, "entries must be a whole number"),
    ("long:recite_list", {"entries": "99999"}, "entries must be a whole number"),
    ("long:recite_passage", {"tokens": "-5"}, "tokens must be a whole number from 1 to 8192"),
    ("long:recite_passage", {"tokens": "300", "entries": "3"}, "unknown long:recite_passage task-arg entries"),
])
def test_bad_task_args_are_one_line(name, args, message):
    with pytest.raises(EvalkitError, match=re.escape(message)) as error:
        TASKS.create(name).with_args(args)
    assert "\n" not in str(error.value)


def test_a_length_too_short_for_the_answer_is_one_line():
    with pytest.raises(EvalkitError, match=r"--length 150 cannot hold long:recite_list: .* raise --length or lower "
                                           r"--task-arg entries$"):
        ReciteList().samples(words, 150, 1, seed=0)


def test_a_filler_that_would_reach_the_passages_is_refused():
    with pytest.raises(EvalkitError, match="more than the essays' first half"):
        RecitePassage().samples(words, len(essay_words()), 1, seed=0)


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_folder(tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_a_run_keeps_each_answers_edit_similarity_and_length(monkeypatch, capsys, tmp_path, tiny_folder):
    from helpers import evalkit, read_run

    code, _, err = evalkit(monkeypatch, capsys, "run", "--model", str(tiny_folder), "--task", "long:recite_list",
                           "--task-arg", "entries=3", "--policy", "h2o_head", "--budget", "0.5", "--length", "400",
                           "--samples", "3", "--out", str(tmp_path), "--wandb", "off")
    assert code == 0, err
    for policy in ("h2o_head", "full"):
        _, records, metrics = read_run(tmp_path, policy)
        task = ReciteList(3)
        for r in records:
            assert r["details"] == task.score_details(r["prediction"], r["references"])
        assert metrics["details"]["edit_similarity"] == sum(r["details"]["edit_similarity"] for r in records) / 3
        assert metrics["new_tokens"] == sum(r["new_tokens"] for r in records) / 3
