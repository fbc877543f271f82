import random
import re

import pytest

from conftest import needs_model_files
from evalkit.assets import default_model_dir
from evalkit.errors import EvalkitError
from evalkit.tasks import TASKS
from evalkit.tasks.haystack import essay_words, fit_size, haystack_text, insert_needles, split_sentences
from evalkit.tasks.metrics import METRICS, postprocess, string_match_all, string_match_part
from evalkit.tasks.ruler_niah import NiahSingle2, NiahSpec, NiahTask


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def prompt_length():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))

    def count(sample):
        return len(tokenizer(sample.context + "\n" + sample.question + sample.answer_prefix).input_ids)

    return count


@pytest.fixture(scope="module")
def niah_samples(prompt_length):
    return NiahSingle2().samples(prompt_length, 2000, 5, seed=7)


# --- metrics ---------------------------------------------------------------------------------

def test_string_match_all_is_the_fraction_of_references_found_ignoring_case():
    assert string_match_all("The code is AB12cd.", ["ab12CD"]) == 1.0
    assert string_match_all("1234567 and 7654321", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_all("nothing here", ["1234567", "7654321"]) == 0.0
    assert string_match_all("123456", ["1234567"]) == 0.0  # a truncated answer is a miss


def test_string_match_part_is_one_when_any_reference_is_found():
    assert string_match_part("it was 7654321", ["1234567", "7654321", "1111111"]) == 1.0
    assert string_match_part("IT WAS PARIS", ["paris", "london"]) == 1.0
    assert string_match_part("nothing here", ["1234567", "7654321"]) == 0.0


def test_predictions_are_cleaned_as_ruler_does():
    assert postprocess("  \tanswer:\x01 42\n ") == "answer:\n 42"
    # A tab becomes a newline, so a reference spanning a newline matches a tab in the prediction.
    assert string_match_all("first\tsecond", ["first\nsecond"]) == 1.0


def ruler_postprocess_pred(predict_str):
    """RULER scripts/eval/evaluate.py's postprocess_pred, written out: strip, control characters to "\\n", strip."""
    predict_str = predict_str.strip()
    return re.sub(r"[\x00-\x1f]", "\n", predict_str).strip()


def ruler_per_sample(pred, ref):
    """The per-sample terms of RULER's string_match_all and string_match_part (synthetic/constants.py),
    whose file score is round(100 * mean, 2) of them."""
    found = [1.0 if r.lower() in pred.lower() else 0.0 for r in ref]
    return sum(found) / len(ref), max(found)


def test_string_match_metrics_equal_rulers_definitions_on_random_cases():
    pieces = ["1234567", "7654321", "ab", "AB", "İ", "i̇", "x", " ", "\n", "\t", "\x00", "\x1f", "\r", "\x7f", "."]
    rng = random.Random("ruler-metrics")

    def text(most):
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, most)))

    for _ in range(3000):
        prediction = text(12)
        references = [text(3) for _ in range(rng.randint(1, 4))]
        expected_all, expected_part = ruler_per_sample(ruler_postprocess_pred(prediction), references)
        assert postprocess(prediction) == ruler_postprocess_pred(prediction), prediction
        assert string_match_all(prediction, references) == expected_all, (prediction, references)
        assert string_match_part(prediction, references) == expected_part, (prediction, references)


def test_metrics_refuse_an_empty_reference_list():
    for metric in METRICS.values():
        with pytest.raises(ValueError):
            metric("anything", [])


def test_metrics_are_registered_by_ruler_names():
    assert {k: METRICS[k] for k in ("string_match_all", "string_match_part")} == {
        "string_match_all": string_match_all, "string_match_part": string_match_part}


# --- haystack --------------------------------------------------------------------------------

def test_haystack_takes_words_in_order_and_repeats_when_too_short():
    words = essay_words()
    assert len(words) > 100_000 and words[:2] == ("July", "2010What")  # addiction.txt comes first
    assert haystack_text(5).split() == list(words[:5])
    assert haystack_text(len(words) + 3).split() == [*words, *words[:3]]


def test_sentences_split_at_sentence_ends_only():
    text = 'He said "Stop." Then e.g. this happened at 5 p.m. today! Was it 1999? (Maybe.) Yes.'
    assert split_sentences(text) == ['He said "Stop."', "Then e.g. this happened at 5 p.m. today!",
                                     "Was it 1999?", "(Maybe.)", "Yes."]
    assert split_sentences("") == []


def test_needles_go_in_at_sentence_boundaries_by_depth():
    text = "A one. B two. C three. D four."
    assert insert_needles(text, ["X.", "Y.", "Z."], [100, 0, 50]) == "Y. A one. B two. Z. C three. D four. X."
    assert insert_needles(text, ["X."], [74]) == "A one. B two. X. C three. D four."
    assert insert_needles("", ["X."], [50]) == "X."


def test_fit_size_lands_just_under_the_budget_in_few_probes():
    probes = []

    def measure(size):  # about linear, with tokenizer-like noise
        probes.append(size)
        return 120 + size * 13 // 10 + size % 3

    for budget in (300, 2000, 30_000):
        probes.clear()
        size = fit_size(measure, budget, guess=budget // 2)
        assert budget - max(4, budget // 200) <= measure(size) <= budget
        assert len(probes) <= 1 + 5
        probes.clear()
        assert fit_size(measure, budget, guess=size) == size and probes == [size]  # a good guess: one probe


def test_fit_size_refuses_a_budget_below_the_fixed_part():
    with pytest.raises(EvalkitError):
        fit_size(lambda size: 500 + size, 400, guess=10)


# --- niah_single_2 ---------------------------------------------------------------------------

def test_registered_under_ruler_name_and_alias_only():
    assert isinstance(TASKS.create("ruler:niah_single_2"), NiahSingle2)
    assert isinstance(TASKS.create("niah_single_2"), NiahSingle2)
    assert not isinstance(TASKS.create("niah"), NiahSingle2)  # "niah" is the gkamradt grid
    task = NiahSingle2()
    assert (task.name, task.metric) == ("ruler:niah_single_2", "string_match_all")
    assert task.description and "RULER" in task.source


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_samples_have_rulers_prompt_and_one_seven_digit_answer(niah_samples):
    assert [s.id for s in niah_samples] == [f"niah_single_2-{i:04d}" for i in range(5)]
    for sample in niah_samples:
        key, (value,) = sample.meta["key"], sample.references
        assert re.fullmatch(r"[1-9]\d{6}", value) and sample.meta["value"] == value
        assert re.fullmatch(r"[a-z]+-[a-z]+", key, flags=re.IGNORECASE)
        assert sample.context.startswith(
            "A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.\n")
        assert sample.question == f"What is the special magic number for {key} mentioned in the provided text?"
        assert sample.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
        assert sample.context.count(value) == 1
        assert sample.context.count(f"One of the special magic numbers for {key} is: {value}.") == 1
        assert sample.max_new_tokens == 128


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_needle_depths_spread_evenly_over_the_samples(niah_samples):
    assert [s.meta["depth"] for s in niah_samples] == [0, 25, 50, 75, 100]
    for sample in niah_samples:
        needle = f"One of the special magic numbers for {sample.meta['key']} is: {sample.meta['value']}."
        before, after = sample.context.split("\n", 1)[1].split(needle)
        sentences_before = len(split_sentences(before.strip()))
        sentences = sentences_before + len(split_sentences(after.strip()))
        assert sentences_before == int(sentences * sample.meta["depth"] / 100)
    assert niah_samples[1].context.split("\n", 1)[1].startswith("July 2010What hard liquor")  # addiction.txt


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("length", [400, 1500, 6000])
def test_prompt_and_answer_fill_the_length_without_passing_it(prompt_length, length):
    for sample in NiahSingle2().samples(prompt_length, length, 3, seed=0):
        assert 0.97 * length <= prompt_length(sample) + sample.max_new_tokens <= length


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_same_seed_same_samples_without_global_random_state(prompt_length):
    task = NiahSingle2()
    random.seed(1)
    state = random.getstate()
    first = task.samples(prompt_length, 1000, 3, seed=5)
    assert random.getstate() == state
    random.seed(2)
    assert task.samples(prompt_length, 1000, 3, seed=5) == first
    other = task.samples(prompt_length, 1000, 3, seed=6)
    assert {s.meta["key"] for s in other}.isdisjoint(s.meta["key"] for s in first)
    assert {s.references[0] for s in other}.isdisjoint(s.references[0] for s in first)


def test_score_uses_string_match_all():
    task = NiahSingle2()
    assert task.score(" 1234567.\n", ["1234567"]) == 1.0
    assert task.score("The number is 7654321", ["1234567"]) == 0.0


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_a_length_with_no_room_for_the_prompt_is_refused(prompt_length):
    with pytest.raises(EvalkitError):
        NiahSingle2().samples(prompt_length, 128, 1, seed=0)
    with pytest.raises(EvalkitError):
        NiahSingle2().samples(prompt_length, 150, 1, seed=0)  # instruction and question alone exceed 22


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_other_variants_are_a_spec_away(prompt_length):
    class MultiQuery(NiahTask):
        name, description = "ruler:niah_multiquery", "test"
        spec = NiahSpec(num_needle_k=4, num_needle_q=4)

    (sample,) = MultiQuery().samples(prompt_length, 1500, 1, seed=3)
    keys = re.findall(r"One of the special magic numbers for (\S+) is: \d{7}\.", sample.context)
    assert len(keys) == 4 and len(sample.references) == 4
    asked = re.fullmatch(r"What are all the special magic numbers for ([\w-]+), ([\w-]+), ([\w-]+), and ([\w-]+) "
                         r"mentioned in the provided text\?", sample.question)
    assert asked and sorted(asked.groups()) == sorted(keys)
    assert sample.context.startswith("Some special magic numbers are hidden")
    assert sample.answer_prefix.endswith("mentioned in the provided text are")
    assert all(sample.context.count(value) == 1 for value in sample.references)


def test_spec_refuses_what_is_not_built():
    with pytest.raises(ValueError):
        NiahSpec(haystack="poetry")  # RULER's haystacks are essay, noise and needle
    with pytest.raises(ValueError):
        NiahSpec(type_needle_v="colours")
    with pytest.raises(ValueError):
        NiahSpec(num_needle_k=1, num_needle_q=2)
