import json
import random

import longbench_reference
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import needs_model_files
from evalkit.assets import default_model_dir
from evalkit.errors import EvalkitError
from evalkit.tasks import TASKS
from evalkit.tasks.base import MAX_CHARS_PER_TOKEN
from evalkit.tasks.longbench import DATA_DIR_ENV, ENGLISH, LongBenchGroup, LongBenchTask, cut_middle, load_records
from evalkit.tasks.metrics import (METRICS, classification, classification_score, code_sim, code_sim_score, count,
                                   count_score, first_line, normalize_answer, qa_f1, qa_f1_score, retrieval,
                                   retrieval_score, rouge_l, rouge_l_score)

# LongBench's config/dataset2maxlen.json and eval.py's dataset2metric, written out independently here.
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                  "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
                  "samsum": 128, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
METRIC = {"narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
          "2wikimqa": "qa_f1", "musique": "qa_f1", "gov_report": "rouge_l", "qmsum": "rouge_l",
          "multi_news": "rouge_l", "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge_l",
          "passage_count": "count", "passage_retrieval_en": "retrieval", "lcc": "code_sim", "repobench-p": "code_sim"}
CLASSES = ["animal", "other animal", "date"]


def record(i, dataset, context="Some passage.", question="Who?", answers=("Ann",), **extra):
    return {"input": question, "context": context, "answers": list(answers), "length": len(context.split()),
            "dataset": dataset, "language": "en", "all_classes": extra.pop("all_classes", None),
            "_id": f"{dataset}-id-{i}", **extra}


def write(folder, dataset, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{dataset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "longbench"
    write(folder, "hotpotqa", [record(i, "hotpotqa", f"Passage {i}: Ann lives in Paris.", f"Where, {i}?",
                                      [f"Paris {i}"]) for i in range(10)])
    write(folder, "trec", [record(i, "trec", "Question: What is a cat?\nType: animal", f"Question: q{i}?\nType:",
                                  ["other animal"], all_classes=CLASSES) for i in range(3)])
    write(folder, "passage_count", [record(0, "passage_count", "Paragraph 1: a.\n\nParagraph 2: a.", "", ["1"])])
    write(folder, "lcc", [record(0, "lcc", "def f():\n    return 1\n", "", ["x = f()"]),
                          record(1, "lcc", "def g():\n    pass", "", ["y = g()"])])
    write(folder, "gov_report", [record(0, "gov_report", "START " + " ".join(f"w{i}" for i in range(6000)) + " END",
                                        "", ["A summary."])])
    return folder


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def prompt_length():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))

    def count_tokens(sample):
        return len(tokenizer(sample.context + "\n" + sample.question + sample.answer_prefix).input_ids)

    return count_tokens


def joined(sample):
    return sample.context + "\n" + sample.question + sample.answer_prefix


# --- registry, lengths, metrics per dataset ---------------------------------------------------

def test_each_english_dataset_and_the_group_are_registered():
    assert set(ENGLISH) == set(MAX_NEW_TOKENS)
    for name in ENGLISH:
        task = TASKS.create(f"longbench:{name}")
        assert isinstance(task, LongBenchTask) and task.name == f"longbench:{name}"
        assert task.metric == METRIC[name] and task.metric in METRICS
        assert task.description and "LongBench" in task.source
    assert isinstance(TASKS.create("longbench"), LongBenchGroup)


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_max_new_tokens_are_longbenchs(data, prompt_length):
    for name in ENGLISH:
        assert LongBenchTask(name).spec.max_new_tokens == MAX_NEW_TOKENS[name]
    for name in ("hotpotqa", "trec", "passage_count", "gov_report"):
        (sample,) = LongBenchTask(name, data).samples(prompt_length, 4096, 1, seed=0)
        assert sample.max_new_tokens == MAX_NEW_TOKENS[name]


# --- loader -----------------------------------------------------------------------------------

def test_loader_reads_local_jsonl_from_the_argument_or_the_environment(data, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    records = load_records("trec", data)
    assert [r["_id"] for r in records] == ["trec-id-0", "trec-id-1", "trec-id-2"]
    assert records[0]["all_classes"] == CLASSES
    monkeypatch.setenv(DATA_DIR_ENV, str(data))
    assert load_records("hotpotqa")[3]["answers"] == ["Paris 3"]
    assert TASKS.create("longbench:trec").all_classes == CLASSES  # the registered task reads the variable


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_samples_carry_references_and_meta(data, prompt_length):
    (sample,) = LongBenchTask("trec", data).samples(prompt_length, 4096, 1, seed=0)
    index = int(sample.id.split("-")[1])
    assert sample.id == f"trec-{index:04d}" and sample.references == ["other animal"]
    assert sample.meta["_id"] == f"trec-id-{index}" and sample.meta["all_classes"] == CLASSES
    assert sample.meta["dataset"] == "trec" and sample.meta["chat_template"] is False
    assert sample.meta["kept_chars"] == sample.meta["context_chars"]  # short context: not cut
    assert "task" not in sample.meta
    (sample,) = LongBenchTask("hotpotqa", data).samples(prompt_length, 4096, 1, seed=0)
    assert sample.meta["chat_template"] is True


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_same_seed_same_samples_without_global_random_state(data, prompt_length):
    task = LongBenchTask("hotpotqa", data)
    random.seed(1)
    state = random.getstate()
    first = task.samples(prompt_length, 4096, 3, seed=5)
    assert random.getstate() == state
    assert task.samples(prompt_length, 4096, 3, seed=5) == first
    assert [s.id for s in task.samples(prompt_length, 4096, 3, seed=6)] != [s.id for s in first]
    assert len({s.id for s in first}) == 3 and [s.id for s in first] == sorted(s.id for s in first)
    with pytest.raises(EvalkitError, match="has 10 samples"):
        task.samples(prompt_length, 4096, 11, seed=0)


def test_no_data_is_a_clear_error_without_trying_the_hub(tmp_path, monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub must not be tried while it is off")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(EvalkitError, match=f"HF_HUB_OFFLINE is set.*{DATA_DIR_ENV}") as error:
        LongBenchTask("hotpotqa").samples(lambda s: 0, 4096, 1, seed=0)
    assert "\n" not in str(error.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(EvalkitError, match="HF_DATASETS_OFFLINE is set"):
        load_records("hotpotqa")
    with pytest.raises(EvalkitError, match="no .*hotpotqa.jsonl"):
        load_records("hotpotqa", tmp_path)  # a folder without the file: no fallback to the hub


def test_the_hub_is_asked_for_the_test_split_when_it_is_on(monkeypatch):
    import datasets

    asked = []

    def fake_load(path, name, split):
        asked.append((path, name, split))
        if name == "musique":
            raise ConnectionError("cannot reach huggingface.co\nsecond line")
        return [record(0, name)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    assert load_records("hotpotqa")[0]["_id"] == "hotpotqa-id-0"
    with pytest.raises(EvalkitError, match=r"cannot load THUDM/LongBench.*\(cannot reach huggingface.co\)") as error:
        load_records("musique")
    assert "\n" not in str(error.value)
    assert asked == [("THUDM/LongBench", "hotpotqa", "test"), ("THUDM/LongBench", "musique", "test")]


def test_malformed_files_are_refused_with_their_place(tmp_path):
    (tmp_path / "hotpotqa.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{not json\n')
    with pytest.raises(EvalkitError, match="hotpotqa.jsonl:2: not JSON"):
        load_records("hotpotqa", tmp_path)
    write(tmp_path, "trec", [{"input": "q", "context": "c", "answers": ["a"]}])
    with pytest.raises(EvalkitError, match="record 1 of trec lacks all_classes"):
        load_records("trec", tmp_path)
    write(tmp_path, "lcc", [record(0, "lcc"), record(1, "lcc", answers=())])
    with pytest.raises(EvalkitError, match="record 2 of lcc needs a non-empty list of answers"):
        load_records("lcc", tmp_path)
    with pytest.raises(EvalkitError, match="unknown LongBench dataset"):
        LongBenchTask("hotpot")


# --- prompts ----------------------------------------------------------------------------------

@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_joined_fields_are_longbenchs_prompt_text(data, prompt_length):
    (hotpot,) = LongBenchTask("hotpotqa", data).samples(prompt_length, 4096, 1, seed=0)
    i = int(hotpot.id.split("-")[1])
    assert joined(hotpot) == (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n"
        f"Passage {i}: Ann lives in Paris.\n\nAnswer the question based on the given passages. Only give me the "
        f"answer and do not output any other words.\n\nQuestion: Where, {i}?\nAnswer:")
    assert hotpot.context.endswith(f"Passage {i}: Ann lives in Paris.") and hotpot.answer_prefix == ""
    assert hotpot.question.startswith("\nAnswer the question")

    (trec,) = LongBenchTask("trec", data).samples(prompt_length, 4096, 1, seed=0)
    i = int(trec.id.split("-")[1])
    assert joined(trec) == ("Please determine the type of the question below. Here are some examples of questions."
                            f"\n\nQuestion: What is a cat?\nType: animal\nQuestion: q{i}?\nType:")
    assert trec.question == f"Question: q{i}?\nType:"

    (counting,) = LongBenchTask("passage_count", data).samples(prompt_length, 4096, 1, seed=0)
    assert joined(counting) == (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\nParagraph 1: a.\n\nParagraph 2: a."
        "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should "
        "only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ")


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_code_prompts_leave_the_codes_last_newline_to_the_separator(data, prompt_length):
    with_newline, without = LongBenchTask("lcc", data).samples(prompt_length, 4096, 2, seed=0)
    assert joined(with_newline) == ("Please complete the code given below. \ndef f():\n    return 1\n"
                                    "Next line of code:\n")
    assert with_newline.context == "Please complete the code given below. \ndef f():\n    return 1"
    # The one difference from LongBench: code without a final newline gets one before the cue.
    assert joined(without) == "Please complete the code given below. \ndef g():\n    pass\nNext line of code:\n"


# --- middle truncation ------------------------------------------------------------------------

def test_cut_middle_balances_the_prompt_around_the_cut():
    assert cut_middle("abcdefghij", 4, before=2, after=0) == "a" + "hij"  # 2+1 chars before the cut, 3 after
    assert cut_middle("abcdefghij", 4, before=0, after=0) == "ab" + "ij"
    assert cut_middle("abcdefghij", 4, before=0, after=10) == "abcd"  # a long question takes the tail's share
    assert cut_middle("abcdefghij", 4, before=10, after=0) == "ghij"
    assert cut_middle("abcdefghij", 10, before=3, after=3) == cut_middle("abcdefghij", 50, 0, 0) == "abcdefghij"
    assert cut_middle("abcdefghij", 0, before=3, after=3) == ""


@pytest.mark.model  # prompt_length: the default model's tokenizer
@pytest.mark.parametrize("length", [1200, 3000])
def test_a_long_context_is_cut_in_the_middle_to_fit_the_length(data, prompt_length, length):
    task = LongBenchTask("gov_report", data)
    (sample,) = task.samples(prompt_length, length, 1, seed=0)
    document = load_records("gov_report", data)[0]["context"]
    head = "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
    assert sample.question == "\nNow, write a one-page summary of the report.\n\nSummary:"
    assert sample.context.startswith(head + "START w0 w1 w2 ")
    assert sample.context.endswith(" w5998 w5999 END")
    kept = sample.context[len(head):]
    assert len(kept) < len(document) / 2 and " w3000 " not in kept  # the middle is gone
    # Head and tail of the document, balanced so that the prompt has as many characters before the
    # cut as after it (LongBench keeps as many tokens on each side).
    before = (len(head) + len(kept) + len(sample.question)) // 2 - len(head)
    assert kept == document[:before] + document[len(document) - (len(kept) - before):]
    assert sample.meta["kept_chars"] == len(kept) and sample.meta["context_chars"] == len(document)
    assert 0.97 * length <= prompt_length(sample) + sample.max_new_tokens <= length


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_a_giant_context_is_never_tokenised_whole_and_is_cut_as_any_other(tmp_path, prompt_length):
    """A 4 MB context (issue #53: 50 MB took 84 s in the tokenizer) cannot fit at any tokenisation: the fit starts from
    as many characters as the length's tokens could hold, and cuts the whole context in the middle as before."""
    folder = tmp_path / "longbench"
    write(folder, "gov_report", [record(0, "gov_report", "START " + "hay " * 1_000_000 + "END", "", ["A summary."])])
    measured = []

    def counting(sample):
        measured.append(len(sample.context))
        return prompt_length(sample)

    (sample,) = LongBenchTask("gov_report", folder).samples(counting, 3000, 1, seed=0)
    assert max(measured) <= 3000 * MAX_CHARS_PER_TOKEN
    document = load_records("gov_report", folder)[0]["context"]
    assert sample.context.endswith(" hay END") and "START hay hay" in sample.context
    kept, head = sample.meta["kept_chars"], len(sample.context) - sample.meta["kept_chars"]
    assert sample.context[head:] == cut_middle(document, kept, head, len(sample.question))
    assert 0.97 * 3000 <= prompt_length(sample) + sample.max_new_tokens <= 3000


@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_a_length_with_no_room_for_the_prompt_is_refused(data, prompt_length):
    with pytest.raises(EvalkitError, match="no room"):
        LongBenchTask("gov_report", data).samples(prompt_length, 512, 1, seed=0)
    with pytest.raises(EvalkitError, match="without its context"):
        LongBenchTask("gov_report", data).samples(prompt_length, 540, 1, seed=0)


# --- metrics, worked by hand ------------------------------------------------------------------

def test_qa_f1_normalises_then_scores_token_overlap():
    assert normalize_answer("The Eiffel Tower, Paris!") == "eiffel tower paris"
    assert normalize_answer("An apple, the theater") == "apple theater"  # articles as words only
    # P = 3/3, R = 3/4 ("in" unmatched): F1 = 2 * 3/4 / (7/4) = 6/7.
    assert qa_f1_score("The Eiffel Tower, Paris!", "Eiffel Tower in Paris") == pytest.approx(6 / 7)
    assert qa_f1_score("paris paris", "Paris") == pytest.approx(2 / 3)  # tokens count with multiplicity
    assert qa_f1_score("paris paris", "Paris paris London") == pytest.approx(0.8)  # 2 shared: P = 1, R = 2/3
    assert qa_f1_score("London", "Paris") == 0.0 and qa_f1_score("the", "a") == 0.0
    assert qa_f1("The Eiffel Tower, Paris!", ["London", "Eiffel Tower in Paris"]) == pytest.approx(6 / 7)


def test_rouge_l_is_the_rouge_packages_union_lcs_over_distinct_words():
    # One sentence each; LCS "the cat on the mat" holds 4 distinct words of 5 on each side: P = R = 4/5.
    assert rouge_l_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8, abs=1e-7)
    # Sentences are cut at ".": each predicted sentence finds its own LCS with the reference (not 0.5).
    assert rouge_l_score("c d. a b", "a b c d") == pytest.approx(1.0, abs=1e-7)
    assert rouge_l_score("the the the", "the") == pytest.approx(1.0, abs=1e-7)  # distinct words (not 0.5)
    # Of the two LCSs of "a b" and "b a", the package's backtrack picks "b"; "a" then comes from the
    # reference's second sentence, so the union holds both words (picking "a" twice would give 0.5).
    assert rouge_l_score("b a", "a b. a") == pytest.approx(1.0, abs=1e-7)
    assert rouge_l_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-7)  # case matters
    # "a. " is the sentences "a" and "" (a blank piece is kept as one empty word): P = 1/2, R = 1, F = 2/3.
    assert rouge_l_score("a. ", "a") == pytest.approx(2 / 3, abs=1e-7)
    assert rouge_l_score("", "a") == rouge_l_score("...", "a") == rouge_l_score("a", "") == 0.0
    assert rouge_l("the cat", ["dog", "the cat"]) == pytest.approx(1.0, abs=1e-7)


def test_classification_needs_the_class_list_and_keeps_longbenchs_removal_quirk():
    assert classification_score("other animal", "other animal", CLASSES) == 1.0  # "animal" found, then dropped
    assert classification_score("date or other animal", "other animal", CLASSES) == 0.5  # two classes named
    assert classification_score("date", "animal", CLASSES) == 0.0
    # LongBench removes while iterating: after dropping "animal" it never examines "mal", which stays.
    assert classification_score("other animal", "other animal", ["animal", "mal", "other animal"]) == 0.5
    assert classification("x: date", ["animal", "date"], all_classes=CLASSES) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        classification("date", ["date"])


def test_retrieval_and_count_score_the_share_of_right_numbers():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("It is paragraph 12, not 1 or 2", "Paragraph 12") == pytest.approx(1 / 3)
    assert retrieval_score("Paragraph 120", "Paragraph 12") == retrieval_score("none", "Paragraph 12") == 0.0
    assert retrieval("Paragraph 4", ["Paragraph 9", "Paragraph 4"]) == 1.0
    with pytest.raises(ValueError, match="Paragraph N"):
        retrieval_score("1", "the first")
    assert count_score("7", "7") == 1.0
    assert count_score("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert count_score("07", "7") == count_score("", "7") == 0.0
    assert count("3 or 4", ["4"]) == 0.5


def test_code_similarity_takes_the_first_code_line_and_fuzzywuzzys_ratio():
    # "x = foo(" and ")" match: 9 of 10 characters each side, ratio 18/20.
    assert code_sim_score("\n```python\n# comment\n// note\nx = foo(2)\n", "x = foo(1)") == 0.9
    assert code_sim_score("abcdefgh", "zzzzzzzh") == 0.12  # 100 * 2/16 = 12.5 rounds half to even
    assert code_sim_score("abcdefgh", "abczzzzz") == 0.38  # 37.5 -> 38
    assert code_sim_score("# only a comment", "x = 1") == 0.0  # no code line: ""
    assert code_sim_score("# only a comment", "") == 1.0  # "" == "": fuzzywuzzy's equality check comes first
    assert code_sim("y = 2", ["x = 1", "y = 2"]) == 1.0


def test_first_line_is_eval_pys_cleaning():
    assert first_line("\n\nother animal\nQuestion: next") == "other animal"
    assert first_line("Paris") == "Paris" and first_line("") == ""


def test_metrics_are_registered_by_name_and_refuse_no_references():
    expected = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification, "retrieval": retrieval,
                "count": count, "code_sim": code_sim}
    assert {name: METRICS[name] for name in expected} == expected
    for name in expected:
        with pytest.raises(ValueError, match="at least one reference"):
            METRICS[name]("anything", [], **({"all_classes": CLASSES} if name == "classification" else {}))


def test_tasks_score_with_eval_pys_cleaning_and_class_list(data):
    trec = LongBenchTask("trec", data)
    # First line only: "other animal" names 1 class; the whole text would name 2 (score 0.5).
    assert trec.score("\nother animal\nType: date", ["other animal"]) == 1.0
    assert classification("\nother animal\nType: date", ["other animal"], all_classes=CLASSES) == 0.5
    assert trec.score("date", ["date"], meta={"all_classes": ["date", "da"]}) == 1.0
    assert LongBenchTask("hotpotqa", data).score("Paris\nExtra words", ["Paris"]) == 0.5  # whole prediction
    assert LongBenchTask("triviaqa", data).score("Paris\nExtra words", ["Paris"]) == 1.0  # first line
    assert LongBenchTask("passage_count", data).score("1", ["1"]) == 1.0


# --- the group --------------------------------------------------------------------------------

@pytest.mark.model  # prompt_length: the default model's tokenizer
def test_group_shares_samples_over_the_english_datasets_and_scores_each_its_way(tmp_path, prompt_length):
    for name in ENGLISH:
        answer = "shared" if name in ("hotpotqa", "2wikimqa") else f"answer {name}"
        extra = {"all_classes": CLASSES} if name == "trec" else {}
        write(tmp_path, name, [record(i, name, answers=[answer], **extra) for i in range(2)])
    group = LongBenchGroup(tmp_path)
    samples = group.samples(prompt_length, 4096, 17, seed=0)
    tasks = [s.meta["task"] for s in samples]
    assert tasks == ["longbench:narrativeqa"] * 2 + [f"longbench:{name}" for name in ENGLISH[1:]]
    assert len({s.id for s in samples}) == 17
    by_task = {s.meta["task"]: s for s in samples}
    trec = by_task["longbench:trec"]
    assert group.score("\nother animal\nType: date", ["other animal"], trec.meta) == 1.0  # first line, classes
    assert group.score("date", ["date"], trec.meta) == 1.0
    assert group.score("answer", ["answer gov_report"], by_task["longbench:gov_report"].meta) == pytest.approx(
        2 * (1 / 2) / (1 + 1 / 2 + 1e-8))  # ROUGE-L: P = 1, R = 1/2
    assert group.score("Paragraph 3", ["Paragraph 3"], {"task": "longbench:passage_retrieval_en"}) == 1.0
    # Without meta, the references of the samples it made tell the dataset, unless two datasets share them.
    assert group.score("answer lcc", ["answer lcc"]) == 1.0  # code_sim of equal lines
    assert group.score("the answer qasper!", ["answer qasper"]) == 1.0  # qa_f1 normalises
    with pytest.raises(ValueError, match="meta"):
        group.score("shared", ["shared"])


# --- metrics against LongBench's published definitions, on random cases ------------------------
#
# tests/longbench_reference.py re-implements LongBench's metrics.py and eval.py (and the rouge and
# fuzzywuzzy calls they make) from the published sources, sharing no code with evalkit. Random
# cases are built from pieces chosen to reach the definitions' corners: articles and punctuation
# (normalize_answer), "." and odd whitespace (rouge's sentence split), characters whose lower case
# is longer (İ), digit runs (count, retrieval), class names that are substrings of one another and
# repeat (classification), and "`", "#", "//" and newlines (code_sim's first code line).
# Seeded runs draw the same cases every time (SEEDED_CASES per metric, DATASET_CASES per dataset);
# hypothesis (HYPOTHESIS_CASES per metric, derandomized) draws more and shrinks a failure to a small case.

SEEDED_CASES = 4000  # per metric: 24,000 cases over the six metrics
HYPOTHESIS_CASES = 100  # per metric: 600 more
DATASET_CASES = 250  # per dataset, through LongBenchTask.score: 4,000 more

PIECES = ["the", "The", "a", "an", "A", "cat", "Cat", "sat", "mat", "on", "Paris", "paris", "naïve", "İ", "ß",
          "1", "7", "12", "07", "٣", "3.5", "x = f(1)", "return", "{", "}", "`", "```", "#", "//", "/", "Paragraph",
          ".", "..", ",", "!", "?", "'", "-", "“", "”", " ", " ", " ", "  ", "\n", "\n\n", "\t", "\r", "\x0b",
          "\x1c", "\u00a0", "\u3000", "\u2028"]
CLASS_NAMES = ["animal", "other animal", "mal", "date", "Date", "location", "other location", "entity",
               "abbreviation", "human being", "human", "an"]
METRIC_NAMES = ["qa_f1", "rouge_l", "count", "retrieval", "classification", "code_sim"]


def random_case(metric, pick):
    """(prediction, ground truth, all_classes or None) for `metric`; `pick` has choice() and randint()."""
    def text(most):
        return "".join(pick.choice(PIECES) for _ in range(pick.randint(0, most)))

    def number():
        return str(pick.randint(0, 25))

    def joined(most, part):
        return " ".join(part() for _ in range(pick.randint(0, most)))

    if metric in ("qa_f1", "rouge_l"):
        return text(40), text(15), None
    if metric == "count":
        return joined(10, lambda: pick.choice([number, lambda: text(3)])()), number(), None
    if metric == "retrieval":
        return (joined(8, lambda: pick.choice([lambda: f"Paragraph {number()}", number, lambda: text(3)])()),
                f"Paragraph {number()}", None)
    if metric == "classification":
        classes = [pick.choice(CLASS_NAMES) for _ in range(pick.randint(0, 8))]  # repeats allowed
        return joined(6, lambda: pick.choice([pick.choice(CLASS_NAMES), text(2)])), pick.choice(CLASS_NAMES), classes
    if metric == "code_sim":
        return "\n".join(text(8) for _ in range(pick.randint(0, 5))), pick.choice([text(8), ""]), None
    raise ValueError(metric)


class Drawn:
    """`random_case`'s choices drawn by hypothesis, so that a failing case shrinks."""

    def __init__(self, data):
        self.data = data

    def choice(self, options):
        return self.data.draw(st.sampled_from(options))

    def randint(self, low, high):
        return self.data.draw(st.integers(low, high))


REFERENCE_SCORES = {"qa_f1": longbench_reference.qa_f1_score, "rouge_l": longbench_reference.rouge_score,
                    "count": longbench_reference.count_score, "retrieval": longbench_reference.retrieval_score,
                    "classification": longbench_reference.classification_score,
                    "code_sim": longbench_reference.code_sim_score}
EVALKIT_SCORES = {"qa_f1": qa_f1_score, "rouge_l": rouge_l_score, "count": count_score,
                  "retrieval": retrieval_score, "classification": classification_score, "code_sim": code_sim_score}


def check_case(metric, prediction, truth, classes):
    extra = {} if classes is None else {"all_classes": classes}
    expected = REFERENCE_SCORES[metric](prediction, truth, **extra)
    got = EVALKIT_SCORES[metric](prediction, truth, *extra.values())
    assert got == expected, (metric, prediction, truth, classes)  # the same float, not merely close


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_each_metric_equals_longbenchs_published_definition(metric):
    rng = random.Random(f"longbench-{metric}")
    for _ in range(SEEDED_CASES):
        check_case(metric, *random_case(metric, rng))


@pytest.mark.parametrize("metric", METRIC_NAMES)
@settings(max_examples=HYPOTHESIS_CASES, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_each_metric_equals_longbenchs_published_definition_shrinking(metric, data):
    check_case(metric, *random_case(metric, Drawn(data)))


@pytest.mark.parametrize("dataset", ENGLISH)
def test_each_dataset_scores_as_longbenchs_eval_py(dataset):
    """The task's score (metric, first-line cut, best over one to three answers) against eval.py's scorer."""
    metric = {"qa_f1_score": "qa_f1", "rouge_score": "rouge_l", "count_score": "count",
              "retrieval_score": "retrieval", "classification_score": "classification",
              "code_sim_score": "code_sim"}[longbench_reference.DATASET2METRIC[dataset].__name__]
    rng = random.Random(f"longbench-{dataset}")
    for _ in range(DATASET_CASES):
        cases = [random_case(metric, rng) for _ in range(rng.randint(1, 3))]
        prediction = rng.choice(["\n", "\n\n", " "]).join(case[0] for case in cases)  # several lines at times
        answers, classes = [case[1] for case in cases], cases[0][2] or CLASS_NAMES
        expected = longbench_reference.score_one(dataset, prediction, answers, classes)
        got = LongBenchTask(dataset).score(prediction, answers, meta={"all_classes": classes})
        assert got == expected, (prediction, answers, classes)


def test_a_retrieval_reference_without_a_paragraph_is_refused_by_both():
    with pytest.raises(IndexError):
        longbench_reference.retrieval_score("1", "the first")
    with pytest.raises(ValueError, match="Paragraph N"):
        retrieval_score("1", "the first")


@pytest.mark.filterwarnings("ignore:Using slow pure-python SequenceMatcher")  # as LongBench's own, on difflib
def test_the_reference_equals_the_published_packages():
    """Checks the reference itself against the packages LongBench scores with, rouge 1.0.1 and fuzzywuzzy 0.18.0
    (requirements.txt: installed with the tests, so this never skips)."""
    import rouge
    from fuzzywuzzy import fuzz

    def published_rouge(prediction, truth):  # metrics.py's rouge_score
        try:
            return rouge.Rouge().get_scores([prediction], [truth], avg=True)["rouge-l"]["f"]
        except Exception:
            return 0.0

    rng = random.Random("published")
    for _ in range(SEEDED_CASES):
        prediction, truth, _ = random_case("rouge_l", rng)
        assert longbench_reference.rouge_score(prediction, truth) == published_rouge(prediction, truth)
        code, line, _ = random_case("code_sim", rng)
        for a, b in ((code, line), (prediction, truth)):
            assert longbench_reference.fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)
