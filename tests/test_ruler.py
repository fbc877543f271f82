"""RULER's thirteen tasks (evalkit.tasks.ruler_niah, ruler_synthetic, ruler_qa) and the `ruler` group."""

import json
import math
import random
import re
from collections import Counter
from dataclasses import replace

import pytest

import evalkit.tasks.ruler as ruler  # registers the tasks
import evalkit.tasks.ruler_qa as ruler_qa
from conftest import needs_model_files
from evalkit.assets import default_model_dir
from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, Sample
from evalkit.tasks.haystack import NOISE
from evalkit.tasks.ruler import Ruler
from evalkit.tasks.ruler_qa import Qa1, Qa2, load_qa, parse_hotpotqa, parse_squad
from evalkit.tasks.ruler_synthetic import CommonWordsExtraction, FrequentWordsExtraction, VariableTracking, zeta
from evalkit.tasks import ruler_niah
from evalkit.tasks.ruler_niah import NIAH_TASKS

LENGTH = 1500
N = 3
SEED = 7
NIAH = [task.name.removeprefix("ruler:") for task in NIAH_TASKS]
ALL = [*NIAH, "vt", "cwe", "fwe", "qa_1", "qa_2"]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+(?: \S+)*?) is: (\S+)\.")


def prompt(sample):
    return sample.context + "\n" + sample.question + sample.answer_prefix


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def prompt_length():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))

    def count(sample):
        return len(tokenizer(prompt(sample)).input_ids)

    return count


# --- QA fixtures, in the format of the files RULER downloads ---------------------------------

FILLER = ("The committee met in the spring and again in the autumn. Records of those meetings were kept "
          "in the town hall, where anyone could read them.")


def squad_json():
    articles = []
    for a in range(8):
        paragraphs = []
        for p in range(5):
            answer = f"Zorblax{a}x{p}"
            context = f"Article {a}, part {p}: guild {a}-{p} was started by its founder {answer}. {FILLER}"
            qas = [{"question": f"Who founded guild {a}-{p}?", "id": f"q{a}{p}",
                    "answers": [{"text": answer, "answer_start": context.index(answer)},
                                {"text": f"founder {answer}", "answer_start": context.index("founder")}],
                    "is_impossible": False},
                   {"question": f"Who closed guild {a}-{p}?", "id": f"i{a}{p}", "answers": [],
                    "plausible_answers": [{"text": answer, "answer_start": 0}], "is_impossible": True}]
            paragraphs.append({"context": context, "qas": qas})
        articles.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": articles}


def hotpot_json():
    records = []
    for r in range(12):
        answer = f"Quibble{r}"
        context = [[f"Title {r}-{c}", [f"Sentence one of {r}-{c} names {answer if c == 1 else 'nobody'}. ",
                                       f"{FILLER}"]] for c in range(4)]
        records.append({"_id": f"h{r}", "answer": answer, "question": f"Which name links item {r}?",
                        "supporting_facts": [[f"Title {r}-1", 0]], "context": context, "type": "bridge",
                        "level": "easy"})
    return records


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qa")
    squad, hotpot = folder / "squad.json", folder / "hotpotqa.json"
    squad.write_text(json.dumps(squad_json()))
    hotpot.write_text(json.dumps(hotpot_json()))
    return {"qa_1": str(squad), "qa_2": str(hotpot)}


def make_task(name, qa_files):
    if name == "qa_1":
        return Qa1(qa_files["qa_1"])
    if name == "qa_2":
        return Qa2(qa_files["qa_2"])
    return TASKS.create(name)


@pytest.fixture(scope="module")
def made(prompt_length, qa_files):
    """N samples of every task at LENGTH, seed SEED."""
    return {name: make_task(name, qa_files).samples(prompt_length, LENGTH, N, SEED) for name in ALL}


# --- registry ---------------------------------------------------------------------------------

def test_every_ruler_task_is_registered_with_rulers_metric_and_generation_length():
    expected = {**{name: ("string_match_all", 128) for name in NIAH}, "vt": ("string_match_all", 30),
                "cwe": ("string_match_all", 120), "fwe": ("string_match_all", 50),
                "qa_1": ("string_match_part", 32), "qa_2": ("string_match_part", 32)}
    assert ruler.RULER_TASKS == tuple(expected)  # synthetic.yaml's order
    for name, (metric, new_tokens) in expected.items():
        task = TASKS.create(f"ruler:{name}")
        assert type(TASKS.create(name)) is type(task) and task.name == f"ruler:{name}"
        assert (task.metric, task.max_new_tokens) == (metric, new_tokens)
        assert task.description and "RULER" in task.source
    assert isinstance(TASKS.create("ruler"), Ruler)


# --- every generator --------------------------------------------------------------------------

@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", ALL)
def test_samples_are_numbered_and_their_answers_are_in_the_context(made, name):
    samples = made[name]
    assert [s.id for s in samples] == [f"{name}-{i:04d}" for i in range(N)]
    for sample in samples:
        assert sample.references and sample.max_new_tokens == TASKS.create(name).max_new_tokens
        for reference in sample.references:
            assert reference in sample.context
        assert "task" not in sample.meta  # only the group names the task


# A haystack grows by whole units (a line, a document), so a prompt can land up to one unit under.
TOLERANCE = {"niah_multikey_3": 90, "qa_1": 60, "qa_2": 60}


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", ALL)
def test_prompt_and_answer_fill_the_length_without_passing_it(made, prompt_length, name):
    for sample in made[name]:
        total = prompt_length(sample) + sample.max_new_tokens
        assert LENGTH - TOLERANCE.get(name, 0.03 * LENGTH) <= total <= LENGTH


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_samples_other_seed_other_samples(made, prompt_length, qa_files, name):
    task = make_task(name, qa_files)
    random.seed(1)
    state = random.getstate()
    again = task.samples(prompt_length, LENGTH, N, SEED)
    assert random.getstate() == state  # no global random state used
    assert again == made[name]
    other = task.samples(prompt_length, LENGTH, N, SEED + 1)
    assert all(a.context != b.context for a, b in zip(other, made[name]))
    if not name.startswith("qa"):  # a small QA fixture can ask the same question twice
        assert {r for s in other for r in s.references}.isdisjoint(r for s in made[name] for r in s.references)


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name", ["niah_single_1", "vt", "cwe", "fwe", "qa_1"])
def test_a_length_with_no_room_for_the_prompt_is_refused(prompt_length, qa_files, name):
    task = make_task(name, qa_files)
    with pytest.raises(EvalkitError):
        task.samples(prompt_length, task.max_new_tokens, 1, seed=0)
    with pytest.raises(EvalkitError):
        task.samples(prompt_length, task.max_new_tokens + 60, 1, seed=0)


# --- niah: the noise and needle haystacks and the registered variants -------------------------

def singular_prompt_parts(key, kind):
    return (f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n",
            f"What is the special magic {kind} for {key} mentioned in the provided text?",
            f" The special magic {kind} for {key} mentioned in the provided text is")


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_noise_haystack_is_rulers_line_repeated_with_the_needle_as_a_line_at_its_depth(made):
    samples = made["niah_single_1"]
    assert [s.meta["depth"] for s in samples] == [0, 50, 100]
    for sample in samples:
        key, (value,) = sample.meta["key"], sample.references
        instruction, question, prefix = singular_prompt_parts(key, "number")
        assert sample.context.startswith(instruction)
        assert (sample.question, sample.answer_prefix) == (question, prefix)
        lines = sample.context[len(instruction):].split("\n")
        needle = f"One of the special magic numbers for {key} is: {value}."
        assert lines.count(needle) == 1 and sample.context.count(value) == 1
        assert lines.count(NOISE) == len(lines) - 1 == sample.meta["haystack_lines"]
        assert lines.index(needle) == int(sample.meta["haystack_lines"] * sample.meta["depth"] / 100)
    assert NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name, kind", [("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids")])
def test_needle_haystack_is_lines_of_distractor_needles(made, name, kind):
    key_pattern = r"[^\W\d_]+(?:[ '-]+[^\W\d_]+)*" if kind == "numbers" else UUID  # jalapeño, tam-o'-shanter
    value_pattern = r"[1-9]\d{6}" if kind == "numbers" else UUID
    for sample in made[name]:
        key, (value,) = sample.meta["key"], sample.references
        instruction, question, prefix = singular_prompt_parts(key, kind[:-1])
        assert sample.context.startswith(instruction)
        assert (sample.question, sample.answer_prefix) == (question, prefix)
        lines = sample.context[len(instruction):].split("\n")
        assert len(lines) == sample.meta["haystack_lines"] + 1 > 10
        found = [NEEDLE.fullmatch(line) for line in lines]
        assert all(m and m.group(1) == kind for m in found)
        assert all(re.fullmatch(key_pattern, m.group(2)) and re.fullmatch(value_pattern, m.group(3)) for m in found)
        assert [m.group(3) for m in found].count(value) == 1 and sample.context.count(value) == 1
        assert [m.group(2) for m in found].count(key) == 1  # no distractor repeats the key asked
        assert len({m.group(2) for m in found}) > len(lines) // 2  # distractors differ from one another


def test_needle_haystack_lines_never_repeat_a_hidden_key_or_value():
    task = ruler_niah.NiahMultikey2()
    needles = task._draw(random.Random(0), 0.5)
    free = [NEEDLE.fullmatch(line).groups() for line in task._distractors(replace(needles, hidden=frozenset()), 6)]
    hidden = frozenset({free[0][1], free[2][2]})
    guarded = "\n".join(task._distractors(replace(needles, hidden=hidden), 6))
    assert free[0][1] not in guarded and free[2][2] not in guarded
    assert f"for {free[1][1]} is: {free[1][2]}." in guarded  # the others are drawn as before


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("name, needles, answers, kind", [
    ("niah_single_2", 1, 1, "numbers"), ("niah_single_3", 1, 1, "uuids"), ("niah_multikey_1", 4, 1, "numbers"),
    ("niah_multivalue", 4, 4, "numbers"), ("niah_multiquery", 4, 4, "numbers")])
def test_essay_variants_hide_and_ask_what_synthetic_yaml_says(made, name, needles, answers, kind):
    value_pattern = r"[1-9]\d{6}" if kind == "numbers" else UUID
    for sample in made[name]:
        found = NEEDLE.findall(sample.context)
        assert len(found) == needles and all(k == kind for k, _, _ in found)
        assert len(sample.references) == answers
        assert all(re.fullmatch(value_pattern, value) and sample.context.count(value) == 1
                   for value in sample.references)
        asked = {key for _, key, value in found if value in sample.references}
        assert sample.question.count(",") == (len(asked) - 1 if len(asked) > 2 else 0)  # "a, b, c, and d"
        assert all(key in sample.question for key in asked)
        if answers == 1:
            assert sample.question.startswith(f"What is the special magic {kind[:-1]} for ")
        else:
            assert sample.context.startswith(f"Some special magic {kind} are hidden within the following text.")
            assert sample.question.startswith(f"What are all the special magic {kind} for ")
            assert sample.answer_prefix.endswith(" mentioned in the provided text are")
    assert len({key for s in made["niah_multivalue"] for _, key, _ in NEEDLE.findall(s.context)}) == N


def test_keys_are_rulers_adjective_noun_pairs_without_stray_spaces():
    # wonderwords' adjective list has "nasty ", "wet " and "blue-eyed "; RULER reads it right-stripped.
    adjectives, _ = ruler_niah._adjectives_and_nouns()
    assert "nasty" in adjectives and not [a for a in adjectives if a != a.strip()]
    assert len(adjectives) == len(set(adjectives)) == 910


# --- vt ----------------------------------------------------------------------------------------

VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def vt_question(value, count=5):
    return (f"Question: Find all variables that are assigned the value {value} in the text above.",
            f" Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
            f"are assigned the value {value}, they are: ")


def chain_lines(names, value):
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_vt_hides_one_five_variable_chain_in_noise_after_a_solved_example(made, prompt_length):
    for sample in made["vt"]:
        value, names = sample.meta["value"], sample.references
        assert re.fullmatch(r"[1-9]\d{4}", value) and len(names) == 5
        assert all(re.fullmatch(r"[A-Z]{5}", name) for name in names) and len(set(names)) == 5
        question, prefix = vt_question(value)
        assert (sample.question, sample.answer_prefix) == (question, prefix)
        empty, example, task = sample.context.split(VT_INSTRUCTION)
        assert empty == "" and example.endswith("\n\n")
        lines = task.split("\n")
        assert [line for line in lines if line != NOISE] == chain_lines(names, value)
        assert len(lines) - 5 == sample.meta["haystack_lines"] and sample.context.count(value) == 1
        # The example: a chain of five three-letter names with its own value, solved.
        example_noise, example_ask = example[:-2].rsplit("\n", 1)
        solved = re.fullmatch(r"(Question: .*)  ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3})", example_ask)
        icl_names = list(solved.groups()[1:])
        icl_lines = [line for line in example_noise.split("\n") if line != NOISE]
        icl_value = icl_lines[0].rsplit(" ", 1)[1]
        assert icl_lines == chain_lines(icl_names, icl_value) and icl_value != value
        assert solved.group(1) == "".join(vt_question(icl_value)).rstrip()
        assert example_noise.count(NOISE) == sample.meta["icl_haystack_lines"]
        # Fitted once to RULER's 500 tokens (answer not counted); names redrawn since move it a little.
        unsolved = Sample("x", VT_INSTRUCTION + example_noise, *vt_question(icl_value), [], 0)
        assert 500 - len(NOISE) < prompt_length(unsolved) <= 505
    assert len({s.context.split(VT_INSTRUCTION)[1][:400] for s in made["vt"]}) == N  # names redrawn per sample


# --- cwe ----------------------------------------------------------------------------------------

CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.\n")
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


def numbered(text):
    """The words of "1. a 2. b ...", checking that the numbers run 1, 2, 3, ..."""
    parts = re.split(r"(?:^| )(\d+)\. ", text)
    assert parts[0] == "" and [int(n) for n in parts[1::2]] == list(range(1, len(parts) // 2 + 1))
    return parts[2::2]


def check_cwe(sample, freq_cw, freq_ucw, example_words, example_freq):
    assert (sample.question, sample.answer_prefix) == (CWE_QUESTION, CWE_PREFIX)
    empty, example, task = sample.context.split(CWE_INSTRUCTION)
    assert empty == ""
    counts = Counter(numbered(task))
    assert len(sample.references) == 10 and len(counts) == sample.meta["haystack_words"] > 10
    assert all(counts[word] == freq_cw for word in sample.references)
    assert all(count == freq_ucw for word, count in counts.items() if word not in sample.references)
    assert (sample.meta["freq_cw"], sample.meta["freq_ucw"]) == (freq_cw, freq_ucw)
    example_list, example_answer = example.split("\n")[:2]
    assert example_answer.startswith(CWE_QUESTION + CWE_PREFIX + " 1. ")
    shown = numbered(example_answer[len(CWE_QUESTION + CWE_PREFIX) + 1:])
    example_counts = Counter(numbered(example_list))
    assert len(shown) == 10 and len(example_counts) == example_words
    assert sorted(example_counts.values()) == sorted([example_freq[0]] * 10 + [example_freq[1]] * (example_words - 10))
    assert all(example_counts[word] == example_freq[0] for word in shown)


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_cwe_below_4096_tokens_uses_rulers_short_settings(made):
    for sample in made["cwe"]:
        check_cwe(sample, 6, 1, 20, (3, 1))


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_cwe_from_4096_tokens_uses_synthetic_yaml(prompt_length):
    (sample,) = CommonWordsExtraction().samples(prompt_length, 4200, 1, seed=3)
    check_cwe(sample, 30, 3, 40, (10, 3))
    assert 4200 * 0.97 <= prompt_length(sample) + 120 <= 4200


# --- fwe ----------------------------------------------------------------------------------------

def test_zeta_matches_known_values():
    assert zeta(2.0) == pytest.approx(math.pi ** 2 / 6, rel=1e-13)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-13)
    assert zeta(1.5) == pytest.approx(2.612375348685488, rel=1e-12)
    with pytest.raises(ValueError):
        zeta(1.0)


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_fwe_word_counts_follow_zipf_with_alpha_two(made):
    vocab_size = (LENGTH - 50) // 50
    for sample in made["fwe"]:
        assert sample.context.startswith("Read the following coded text and track the frequency of each coded "
                                         "word. Find the three most frequently appeared coded words. ")
        assert sample.question == ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                                   "What are the three most frequently appeared words in the above coded text?")
        assert sample.answer_prefix == (" Answer: According to the coded text above, the three most frequently "
                                        "appeared words are:")
        words = sample.context.split(". ", 2)[2].split(" ")
        counts = Counter(words)
        size = sample.meta["num_words"]
        assert all(re.fullmatch(r"[a-z]{6}", word) for word in counts if word != "...")
        assert len(counts) <= vocab_size == sample.meta["vocab_size"] and len(words) == sample.meta["coded_words"]
        assert counts["..."] == int(size / (math.pi ** 2 / 6))
        for rank, word in enumerate(sample.references, start=2):
            assert counts[word] == int(size * rank ** -2 / (math.pi ** 2 / 6))
        assert [word for word, _ in counts.most_common(4)] == ["...", *sample.references]


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_fwe_refuses_a_length_too_short_for_a_vocabulary(prompt_length):
    with pytest.raises(EvalkitError):
        FrequentWordsExtraction().samples(prompt_length, 240, 1, seed=0)


# --- qa -----------------------------------------------------------------------------------------

QA_HEAD = ("Answer the question based on the given documents. Only give me the answer and do not output any "
           "other words.\n\nThe following are given documents.\n\n")


def documents(context):
    assert context.startswith(QA_HEAD)
    parts = re.split(r"(?:^|\n\n)Document (\d+):\n", context[len(QA_HEAD):])
    assert parts[0] == "" and [int(n) for n in parts[1::2]] == list(range(1, len(parts) // 2 + 1))
    return parts[2::2]


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_qa_prompt_is_rulers_template(made):
    for sample in made["qa_1"] + made["qa_2"]:
        joined = prompt(sample)
        assert joined.startswith(QA_HEAD)
        assert re.search(r"\n\nAnswer the question based on the given documents\. Only give me the answer and do "
                         r"not output any other words\.\n\nQuestion: [^\n]+\? Answer:\Z", joined)
        assert sample.answer_prefix == " Answer:"


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_squad_sample_has_its_paragraph_once_after_same_article_distractors(made):
    data = parse_squad(squad_json())
    for sample in made["qa_1"]:
        docs = documents(sample.context)
        assert len(docs) == sample.meta["documents"] > 5 and len(set(docs)) == len(docs)
        answer, also = sample.references
        assert also == f"founder {answer}"  # every answer text is a reference
        gold = [i + 1 for i, doc in enumerate(docs) if answer in doc]
        assert gold == sample.meta["gold_documents"] and sample.context.count(answer) == 1
        article = answer[len("Zorblax"):].split("x")[0]
        # RULER's first distractors are the other paragraphs of the same article, all five fit here.
        assert sum(doc.startswith(f"Article {article},") for doc in docs) == 5
        assert set(docs) <= set(data.docs)


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_qa_distractors_beyond_the_article_are_drawn_at_random(made):
    data = parse_squad(squad_json())
    for sample in made["qa_1"]:
        article = sample.references[0][len("Zorblax"):].split("x")[0]
        others = [doc for doc in documents(sample.context) if not doc.startswith(f"Article {article},")]
        first = [doc for doc in data.docs if not doc.startswith(f"Article {article},")][:len(others)]
        assert len(others) > 3 and sorted(others) != first  # not RULER's sorted order


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_hotpotqa_sample_has_all_its_paragraphs(made):
    for sample in made["qa_2"]:
        docs = documents(sample.context)
        (answer,) = sample.references
        number = answer[len("Quibble"):]
        own = [doc for doc in docs if doc.startswith(f"Title {number}-")]
        assert len(own) == 4 and len(docs) == sample.meta["documents"] > 4
        assert sample.context.count(answer) == 1 and sample.question.endswith(f"item {number}?")


def test_squad_and_hotpotqa_are_read_as_ruler_reads_them():
    squad = parse_squad(squad_json())
    assert len(squad.items) == 40 and len(squad.docs) == 40  # the impossible questions are left out
    item = squad.items[7]
    assert item.query == "Who founded guild 1-2?" and item.outputs == ("Zorblax1x2", "founder Zorblax1x2")
    assert squad.docs[item.gold[0]].startswith("Article 1, part 2:")
    assert sorted(squad.docs[i][:18] for i in item.more) == [f"Article 1, part {p}:" for p in (0, 1, 3, 4)]
    hotpot = parse_hotpotqa(hotpot_json())
    assert len(hotpot.items) == 12 and len(hotpot.docs) == 48 and hotpot.items[3].outputs == ("Quibble3",)
    assert hotpot.docs[hotpot.items[3].gold[1]] == f"Title 3-1\nSentence one of 3-1 names Quibble3. {FILLER}"


def test_hub_rows_are_regrouped_into_rulers_files():
    rows = [{"title": "A", "context": "c1", "question": "q1", "answers": {"text": ["x"], "answer_start": [0]}},
            {"title": "A", "context": "c1", "question": "q2", "answers": {"text": [], "answer_start": []}},
            {"title": "A", "context": "c2", "question": "q3", "answers": {"text": ["y", "z"], "answer_start": [0, 0]}},
            {"title": "B", "context": "c3", "question": "q4", "answers": {"text": ["w"], "answer_start": [0]}}]
    data = parse_squad(ruler_qa._squad_from_hub(rows))
    assert [(i.query, i.outputs, [data.docs[d] for d in i.gold], sorted(data.docs[d] for d in i.more))
            for i in data.items] == [("q1", ("x",), ["c1"], ["c2"]), ("q3", ("y", "z"), ["c2"], ["c1"]),
                                     ("q4", ("w",), ["c3"], [])]
    hotpot = [{"question": "q", "answer": "a", "context": {"title": ["T1", "T2"], "sentences": [["s1", "s2"], ["s3"]]}}]
    data = parse_hotpotqa(ruler_qa._hotpotqa_from_hub(hotpot))
    assert data.docs == ("T1\ns1s2", "T2\ns3") and data.items[0].gold == (0, 1)


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_qa_data_comes_from_the_environment_variable(monkeypatch, qa_files, prompt_length):
    monkeypatch.setenv("EVALKIT_RULER_SQUAD", qa_files["qa_1"])
    (sample,) = TASKS.create("qa_1").samples(prompt_length, 800, 1, seed=0)
    assert "Zorblax" in sample.context


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_qa_without_data_says_why_in_one_line_and_never_reaches_the_hub(monkeypatch, tmp_path, prompt_length):
    monkeypatch.delenv("EVALKIT_RULER_SQUAD", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was called")

    monkeypatch.setattr("datasets.load_dataset", no_hub)
    with pytest.raises(EvalkitError, match="EVALKIT_RULER_SQUAD") as error:
        TASKS.create("qa_1").samples(prompt_length, 2000, 1, seed=0)
    assert "\n" not in str(error.value) and "HF_HUB_OFFLINE" in str(error.value)
    with pytest.raises(EvalkitError, match="no file"):
        load_qa("hotpotqa", tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(EvalkitError, match="not JSON"):
        load_qa("squad", tmp_path / "bad.json")
    (tmp_path / "wrong.json").write_text(json.dumps(hotpot_json()))
    with pytest.raises(EvalkitError, match="format"):
        load_qa("squad", tmp_path / "wrong.json")


def test_qa_data_comes_from_the_hub_when_it_is_on(monkeypatch):
    monkeypatch.delenv("EVALKIT_RULER_HOTPOTQA", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        if len(calls) > 1:
            raise ConnectionError("hub unreachable\nmore detail")
        return [{"question": "q", "answer": "a", "context": {"title": ["T"], "sentences": [["s"]]}}]

    monkeypatch.setattr("datasets.load_dataset", fake_load)
    ruler_qa._read_hub.cache_clear()
    try:
        assert load_qa("hotpotqa").docs == ("T\ns",)
        assert calls == [("hotpotqa/hotpot_qa", "distractor", "validation")]
        with pytest.raises(EvalkitError, match=r"\(hub unreachable\); set EVALKIT_RULER_SQUAD") as error:
            load_qa("squad")
        assert calls[1] == ("rajpurkar/squad_v2", None, "validation") and "\n" not in str(error.value)
    finally:
        ruler_qa._read_hub.cache_clear()


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_qa_refuses_more_samples_than_questions(qa_files, prompt_length):
    with pytest.raises(EvalkitError, match="12 answerable"):
        Qa2(qa_files["qa_2"]).samples(prompt_length, LENGTH, 13, seed=0)


# --- metrics ------------------------------------------------------------------------------------

@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_each_task_scores_with_rulers_metric(made):
    multivalue = made["niah_multivalue"][0].references
    assert TASKS.create("niah_multivalue").score(f"{multivalue[0]}, {multivalue[2]}", multivalue) == 0.5
    vt = made["vt"][0].references
    assert TASKS.create("vt").score(" ".join(vt[:3]).lower(), vt) == pytest.approx(0.6)
    cwe = made["cwe"][0].references
    assert TASKS.create("cwe").score(" ".join(f"{i + 1}. {w}" for i, w in enumerate(cwe)), cwe) == 1.0
    assert TASKS.create("cwe").score("1. something", cwe) == 0.0
    fwe = made["fwe"][0].references
    assert TASKS.create("fwe").score(f" {fwe[1]} ...", fwe) == pytest.approx(1 / 3)
    for name in ("qa_1", "qa_2"):
        assert TASKS.create(name).score("It was ZORBLAX1X2.", ["zorblax1x2", "founder zorblax1x2"]) == 1.0
        assert TASKS.create(name).score("Nobody", ["zorblax1x2", "founder zorblax1x2"]) == 0.0


# --- the group ----------------------------------------------------------------------------------

@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_group_takes_n_samples_of_every_task_and_scores_each_by_its_own_metric(
        monkeypatch, qa_files, prompt_length, made):
    monkeypatch.setenv("EVALKIT_RULER_SQUAD", qa_files["qa_1"])
    monkeypatch.setenv("EVALKIT_RULER_HOTPOTQA", qa_files["qa_2"])
    group = TASKS.create("ruler")
    assert "skipped" not in group.description
    samples = group.samples(prompt_length, LENGTH, N, SEED)
    assert [s.meta["task"] for s in samples] == [name for name in ALL for _ in range(N)]
    assert len({s.id for s in samples}) == len(samples)
    for sample in samples:  # the very samples each task makes alone, with the same seed
        alone = made[sample.meta["task"]][int(sample.id[-4:])]
        assert sample.meta == {**alone.meta, "task": sample.meta["task"]}
        assert (sample.id, sample.context, sample.references) == (alone.id, alone.context, alone.references)
    qa = samples[ALL.index("qa_1") * N]
    assert group.score(qa.references[0], qa.references) == 1.0  # string_match_part
    multivalue = samples[ALL.index("niah_multivalue") * N]
    assert group.score(multivalue.references[0], multivalue.references) == 0.25  # string_match_all
    assert group.score(multivalue.references[0], multivalue.references, meta={"task": "qa_1"}) == 1.0
    with pytest.raises(ValueError):
        group.score("x", ["never made"])


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_group_skips_qa_without_data_and_says_so(monkeypatch, prompt_length):
    monkeypatch.delenv("EVALKIT_RULER_SQUAD", raising=False)
    monkeypatch.delenv("EVALKIT_RULER_HOTPOTQA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    group = Ruler()
    assert "skipped for want of data: qa_1 (set EVALKIT_RULER_SQUAD), qa_2 (set EVALKIT_RULER_HOTPOTQA)" \
        in group.description and "HF_HUB_OFFLINE" in group.skipped["qa_1"]
    samples = group.samples(prompt_length, 1200, 1, seed=0)
    assert [s.meta["task"] for s in samples] == ALL[:-2]
