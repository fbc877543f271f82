"""Data tasks: the user's JSONL files and datasets in kvpress's, RULER's and LongBench's formats."""

import json
import time

import pytest

from evalkit.config import RunConfig, fields_where
from evalkit.errors import EvalkitError
from evalkit.tasks.custom import MAX_CHARS_PER_TOKEN, RULER_MAX_NEW_TOKENS, DataTask, make_task
from evalkit.tasks.metrics import exact
from helpers import evalkit

KVPRESS = [
    {"id": "code-a", "task": "codes", "context": "The code of the blue door is 4817. The weather was mild.",
     "question": "What is the code of the blue door?", "answer_prefix": "The code of the blue door is",
     "answers": "4817", "max_new_tokens": 8},
    {"id": "code-b", "task": "codes", "context": "The code of the red door is 9052. Nothing else happened.",
     "question": "What is the code of the red door?", "answer_prefix": "The code of the red door is",
     "answers": ["9052"], "max_new_tokens": 8},
    {"id": "city-a", "task": "cities", "context": "Anna moved to Lisbon in 2019 and has lived there since.",
     "question": "Which city does Anna live in?", "answer_prefix": "Anna lives in", "answer": ["Lisbon"],
     "max_new_tokens": 8},
    {"id": "city-b", "task": "cities", "context": "Marco moved to Oslo in 2015 and has lived there since.",
     "question": "Which city does Marco live in?", "answer_prefix": "Marco lives in", "answer": "Oslo",
     "max_new_tokens": 8},
]
RULER = [  # RULER's prepare.py: the question is inside `input`, the answer prefix beside it
    {"index": 7, "input": "A haystack. One of the special magic numbers for cat is: 123. More hay. What is the "
     "special magic number for cat mentioned in the provided text?", "outputs": ["123"], "length": 40,
     "length_w_model_temp": 52, "answer_prefix": " The special magic number for cat mentioned in the provided text is"},
    {"index": 9, "input": "Hay. The special magic numbers for dog are: 4 and 5. What are all the special magic "
     "numbers for dog?", "outputs": ["4", "5"], "length": 30, "answer_prefix": " The numbers are"},
]


def longbench_record(i, context="Ann lives in Paris. " * 3):
    return {"input": f"Where does Ann live, {i}?", "context": context, "answers": [f"Paris {i}"],
            "length": len(context.split()), "dataset": "hotpotqa", "language": "en", "all_classes": None,
            "_id": f"hotpotqa-id-{i}"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def words(sample):
    """A stand-in tokenizer: one token a word of the whole prompt."""
    return len((sample.context + "\n" + sample.question + sample.answer_prefix).split())


def task_of(path, **options):
    return DataTask(f"jsonl:{path}", **options)


def test_kvpress_records_keep_question_answer_prefix_ids_and_tasks(tmp_path):
    task = task_of(write_jsonl(tmp_path / "kv.jsonl", KVPRESS))
    assert (task.data_format, task.metric, task.question_split) == ("kvpress", "string_match_all", True)
    samples = task.samples(words, 2048, 4, seed=0)
    assert [s.id for s in samples] == ["code-a", "code-b", "city-a", "city-b"]
    first = samples[0]
    assert (first.context, first.question, first.answer_prefix) == (
        KVPRESS[0]["context"], KVPRESS[0]["question"], KVPRESS[0]["answer_prefix"])
    # `answers` or kvpress's `answer`, a string or a list: always a list of references.
    assert [s.references for s in samples] == [["4817"], ["9052"], ["Lisbon"], ["Oslo"]]
    assert [s.max_new_tokens for s in samples] == [8] * 4
    assert [s.meta["task"] for s in samples] == ["codes", "codes", "cities", "cities"]


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_ruler_records_compress_the_whole_input(tmp_path):
    task = task_of(write_jsonl(tmp_path / "niah.jsonl", RULER))
    assert (task.data_format, task.question_split) == ("ruler", False)
    samples = task.samples(words, 2048, 2, seed=0)
    assert [s.id for s in samples] == ["7", "9"]  # RULER's index
    assert [s.context for s in samples] == [r["input"] for r in RULER] and all(s.question == "" for s in samples)
    assert [s.answer_prefix for s in samples] == [r["answer_prefix"] for r in RULER]
    assert [s.references for s in samples] == [["123"], ["4", "5"]]
    assert [s.meta["length"] for s in samples] == [40, 30]
    assert all(s.max_new_tokens == RULER_MAX_NEW_TOKENS for s in samples)
    shorter = task_of(tmp_path / "niah.jsonl", task_args={"max_new_tokens": "16"})
    assert all(s.max_new_tokens == 16 for s in shorter.samples(words, 2048, 2, seed=0))
    config = RunConfig(task=f"jsonl:{tmp_path / 'niah.jsonl'}").validate()
    assert config.to_dict()["question_split"] is False and config.data_format == "ruler"


# LongBench's config/dataset2prompt.json entry for hotpotqa, written out here.
HOTPOTQA_PROMPT = ("Answer the question based on the given passages. Only give me the answer and do not output any "
                   "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
                   "the given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                   "{input}\nAnswer:")


def test_longbench_records_are_longbench_samples_cut_to_the_length(tmp_path):
    records = [longbench_record(i) for i in range(3)]
    document = "START " + " ".join(f"w{i}" for i in range(400)) + " END"
    records[2] = longbench_record(2, context=document)
    folder = tmp_path / "longbench"
    folder.mkdir()
    write_jsonl(folder / "hotpotqa.jsonl", records)
    task = task_of(folder / "hotpotqa.jsonl")
    assert (task.data_format, task.metric, task.question_split) == ("longbench", "qa_f1", True)
    samples = task.samples(words, 4096, 3, seed=0)
    assert [s.id for s in samples] == ["hotpotqa-0000", "hotpotqa-0001", "hotpotqa-0002"]
    for sample, record in zip(samples, records):  # room for everything: LongBench's prompt, whole
        assert sample.context + "\n" + sample.question + sample.answer_prefix == HOTPOTQA_PROMPT.format(**record)
        assert sample.references == record["answers"] and sample.max_new_tokens == 32  # dataset2maxlen.json
        assert sample.meta["_id"] == record["_id"]

    # 200 tokens (words here): the long context is cut in the middle, its head and tail kept.
    *short, cut = task.samples(words, 200, 3, seed=0)
    assert short == samples[:2]  # short enough already: untouched
    head, tail = HOTPOTQA_PROMPT.split("{context}")
    assert cut.context.startswith(head + "START w0 w1 w2 ") and cut.context.endswith(" w398 w399 END")
    assert "\n" + cut.question == tail.format(input=records[2]["input"])  # the question is never cut
    kept = cut.context[len(head):]
    assert " w200 " not in kept and cut.meta["kept_chars"] == len(kept) < cut.meta["context_chars"] == len(document)
    # The document's head and tail, balanced so that the prompt has as many characters before the cut
    # as after it (the question included), as in test_longbench.py.
    before = (len(head) + len(kept) + len(cut.question)) // 2 - len(head)
    assert kept == document[:before] + document[len(document) - (len(kept) - before):]
    # Fitted to 200 - 32 new tokens = 168 prompt words, within fit_size's max(4, 168 // 200) = 4 words.
    assert 168 - 4 <= words(cut) <= 168

    # LongBench's own metric, qa_f1: normalised "paris 0 it is" against "paris 0": 2 tokens shared,
    # P = 2/4, R = 2/2, F1 = 2 * (1/2) * 1 / (1/2 + 1) = 2/3.
    assert task.score("Paris 0 it is", ["Paris 0"]) == pytest.approx(2 / 3)
    # Another metric on request: exact match after normalising "the Paris 0." to "paris 0".
    assert task_of(folder / "hotpotqa.jsonl", metric="exact").score("the Paris 0.", ["Paris 0"]) == 1.0


# "It is 4817" against ["4817", "9999"], worked by hand:
#   string_match_all: "4817" found, "9999" not: 1/2; string_match_part: one found: 1;
#   exact: "it is 4817" is neither "4817" nor "9999": 0;
#   f1 (qa_f1): tokens [it, is, 4817] vs [4817]: P = 1/3, R = 1, F1 = 2 * (1/3) / (4/3) = 1/2 (0 for "9999");
#   rouge_l: one sentence each; distinct words 3 predicted, 1 reference, 1 on the LCS: P = 1/3, R = 1,
#            F = 2 * (1/3 * 1) / (1/3 + 1 + 1e-8) (the rouge package's 1e-8).
@pytest.mark.parametrize("metric, expected", [
    (None, 0.5), ("string_match_all", 0.5), ("string_match_part", 1.0), ("exact", 0.0),
    ("f1", 0.5), ("rouge_l", 2 * (1 / 3) / (1 / 3 + 1 + 1e-8)),
])
def test_the_metric_is_chosen_from_the_task_metrics(tmp_path, metric, expected):
    task = task_of(write_jsonl(tmp_path / "kv.jsonl", KVPRESS), metric=metric)
    assert task.score("It is 4817", ["4817", "9999"]) == pytest.approx(expected, rel=1e-12)


def test_exact_match_is_squad_exact_match():
    assert exact("The Eiffel  tower!", ["eiffel tower"]) == 1.0
    assert exact("Eiffel tower, Paris", ["eiffel tower", "paris"]) == 0.0
    assert exact("Paris", ["London", "paris"]) == 1.0
    with pytest.raises(ValueError):
        exact("Paris", [])


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_limit_and_offset_select_a_slice_and_samples_follow_it(tmp_path):
    path = write_jsonl(tmp_path / "kv.jsonl", KVPRESS)
    task = task_of(path, offset=1, limit=2)
    assert [s.id for s in task.samples(words, 2048, 2, seed=0)] == ["code-b", "city-a"]
    with pytest.raises(EvalkitError, match="2 records selected; 3 asked for"):
        task.samples(words, 2048, 3, seed=0)
    assert RunConfig(task=f"jsonl:{path}", offset=3, limit=5).validate().samples == 1
    assert RunConfig(task=f"jsonl:{path}", samples=2).validate().samples == 4  # every record, not --samples'


def test_ids_default_to_the_position_and_duplicates_are_refused(tmp_path):
    anonymous = [{key: value for key, value in record.items() if key != "id"} for record in KVPRESS]
    assert [s.id for s in task_of(write_jsonl(tmp_path / "a.jsonl", anonymous), offset=2)
            .samples(words, 2048, 2, seed=0)] == ["2", "3"]
    twice = [KVPRESS[0], KVPRESS[1], dict(KVPRESS[2], id="code-a")]
    with pytest.raises(EvalkitError, match="records 1 and 3 have the same id 'code-a'"):
        task_of(write_jsonl(tmp_path / "b.jsonl", twice))


def test_samples_over_the_length_are_refused_not_cut(tmp_path):
    task = task_of(write_jsonl(tmp_path / "niah.jsonl", RULER), task_args={"max_new_tokens": "10"})
    needed = [words(s) + 10 for s in task.samples(words, 2048, 2, seed=0)]
    assert task.samples(words, max(needed), 2, seed=0)
    with pytest.raises(EvalkitError, match=rf"1 of 2 samples need more than --length {max(needed) - 1} tokens "
                                           rf"\(prompt \+ max_new_tokens; sample 7 needs {max(needed)}\)"):
        task.samples(words, max(needed) - 1, 2, seed=0)


def test_a_giant_record_is_refused_naming_it_before_anything_is_tokenised(tmp_path):
    """Issue #34: one 50 MB record hung a run while the tokenizer went through it."""
    path = tmp_path / "giant.jsonl"
    giant = dict(KVPRESS[1], context="hay " * 12_500_000)  # 50 MB
    path.write_text(json.dumps(KVPRESS[0]) + "\n" + json.dumps(giant) + "\n")

    def no_tokenizer(sample):
        raise AssertionError("tokenised")

    started = time.monotonic()
    task = task_of(path)
    with pytest.raises(EvalkitError) as refused:
        task.samples(no_tokenizer, 2048, 2, seed=0)
    assert time.monotonic() - started < 10
    chars = len(giant["context"]) + len(giant["question"]) + len(giant["answer_prefix"])
    assert str(refused.value) == (f"{path}: record 2 (id 'code-b') has {chars:,} characters of prompt, more than "
                                  f"--length 2048 tokens hold at {MAX_CHARS_PER_TOKEN} characters a token: data "
                                  "samples are never cut; skip it with --offset/--limit")
    assert task_of(path, limit=1).samples(words, 2048, 1, seed=0)[0].id == "code-a"  # the records before it run
    with pytest.raises(EvalkitError, match="more than the model's window of 8192 tokens hold"):
        task.check_sizes(8192, "the model's window of 8192")  # as a run can check before any model loads
    # The bound is never below what fits: a prompt of one character a token, at --length, passes it.
    fits = dict(KVPRESS[0], context="a" * (2048 * MAX_CHARS_PER_TOKEN - len(KVPRESS[0]["question"])
                                          - len(KVPRESS[0]["answer_prefix"])))
    assert task_of(write_jsonl(tmp_path / "edge.jsonl", [fits])).samples(lambda sample: 1, 2048, 1, seed=0)


def test_limit_stops_reading_the_file(tmp_path):
    """Records past offset + limit are never read: a bad line (or a giant record) after them costs nothing."""
    path = tmp_path / "kv.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in KVPRESS[:2]) + "{not json\n")
    task = task_of(path, limit=2)
    assert [s.id for s in task.samples(words, 2048, 2, seed=0)] == ["code-a", "code-b"]
    assert task_of(path, offset=1, limit=1).indices == range(1, 2)
    with pytest.raises(EvalkitError, match="kv.jsonl:3: not JSON"):
        task_of(path, limit=3)
    with pytest.raises(EvalkitError, match="kv.jsonl:3: not JSON"):
        task_of(path)


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_the_run_id_follows_the_data_and_its_options(tmp_path):
    path = write_jsonl(tmp_path / "kv.jsonl", KVPRESS)

    def run_id(**options):
        return RunConfig(task=f"jsonl:{path}", **options).validate().run_id()

    base = run_id()
    assert base.startswith("kv-h2o_head-0.2-")
    assert run_id(data_format="auto") == run_id(data_format="kvpress") == base  # the same run, said twice
    assert run_id(metric="f1") == run_id(metric="qa_f1") != base
    others = {run_id(metric="exact"), run_id(limit=2), run_id(offset=1), run_id(limit=2, offset=1),
              run_id(task_args={"max_new_tokens": "4"})}
    assert len(others) == 5 and base not in others
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in KVPRESS))  # other bytes, same records
    assert run_id() == base
    write_jsonl(path, [KVPRESS[0], KVPRESS[1], dict(KVPRESS[2], context="Anna moved to Porto."), KVPRESS[3]])
    assert run_id() != base  # an edited record is a new run, not a finished one
    assert run_id(limit=2) == RunConfig(task=f"jsonl:{path}", limit=2).validate().run_id()
    copy = write_jsonl(tmp_path / "copy.jsonl", KVPRESS)
    assert RunConfig(task=f"jsonl:{copy}").validate().run_id() != base  # another file


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_registered_tasks_keep_their_run_ids_free_of_data_options():
    config = RunConfig().validate()
    assert not set(fields_where(data=True)) & set(config.identity())
    assert config.to_dict()["data_format"] is None and config.question_split is None


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_a_saved_dataset_and_a_data_folder_load_through_datasets(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    expected = task_of(write_jsonl(tmp_path / "kv.jsonl", KVPRESS)).samples(words, 2048, 4, seed=0)
    rows = [{key: record.get(key) for key in ("id", "task", "context", "question", "answer_prefix", "max_new_tokens")}
            | {"answers": record.get("answers", record.get("answer"))} for record in KVPRESS]
    rows = [dict(row, answers=[row["answers"]] if isinstance(row["answers"], str) else row["answers"]) for row in rows]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "data.jsonl", rows)
    for name in (f"hf:{tmp_path / 'saved'}:test", f"hf:{tmp_path / 'saved_dict'}:test",
                 f"hf:{tmp_path / 'folder'}:train"):
        task = DataTask(name)
        assert task.data_format == "kvpress" and task.samples(words, 2048, 4, seed=0) == expected
    config = RunConfig(task=f"hf:{tmp_path / 'saved_dict'}:test", limit=3).validate()
    assert config.run_id().startswith("saved_dict-") and config.samples == 3
    with pytest.raises(EvalkitError, match=r"no split 'train'; it has test"):
        DataTask(f"hf:{tmp_path / 'saved_dict'}:train")
    with pytest.raises(EvalkitError, match=r"cannot load the dataset \(Unknown split"):
        DataTask(f"hf:{tmp_path / 'folder'}:validation")


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_make_task_builds_the_data_task_the_config_resolved(tmp_path):
    path = write_jsonl(tmp_path / "kv.jsonl", KVPRESS)
    config = RunConfig(task=f"jsonl:{path}", metric="string_match_part", offset=2).validate()
    task = make_task(config)
    assert [s.id for s in task.samples(words, config.length, config.samples, config.seed)] == ["city-a", "city-b"]
    assert task.metric == "string_match_part" and task.sha256 == config.data_sha256


def bad_files(folder):
    write_jsonl(folder / "kv.jsonl", KVPRESS)
    (folder / "malformed.jsonl").write_text(json.dumps(KVPRESS[0]) + "\n\n" + '{"context": "c", "question":\n')
    write_jsonl(folder / "no_question.jsonl", [KVPRESS[0], {k: v for k, v in KVPRESS[1].items() if k != "question"}])
    write_jsonl(folder / "no_answers.jsonl", [{k: v for k, v in KVPRESS[0].items() if k != "answers"}])
    write_jsonl(folder / "no_tokens.jsonl", [{k: v for k, v in KVPRESS[0].items() if k != "max_new_tokens"}])
    write_jsonl(folder / "half_tasks.jsonl", [KVPRESS[0], {k: v for k, v in KVPRESS[1].items() if k != "task"}])
    write_jsonl(folder / "unknown.jsonl", [{"prompt": "p", "target": "t"}])
    write_jsonl(folder / "two_datasets.jsonl", [longbench_record(0), dict(longbench_record(1), dataset="trec")])
    (folder / "empty.jsonl").write_text("\n\n")
    (folder / "latin1.jsonl").write_bytes(json.dumps(KVPRESS[0]).encode() + b"\n" + b'{"context": "caf\xe9"}\n')


@pytest.mark.parametrize("args, message", [
    (["--task", "jsonl:{dir}/missing.jsonl"], "no data file '{dir}/missing.jsonl'"),
    (["--task", "jsonl:{dir}"], "is not a file"),
    (["--task", "jsonl:{dir}/malformed.jsonl"], "malformed.jsonl:3: not JSON"),
    (["--task", "jsonl:{dir}/latin1.jsonl"], "latin1.jsonl:2: not UTF-8 text"),
    (["--task", "jsonl:{dir}/no_question.jsonl"], "record 2 lacks the column 'question'"),
    (["--task", "jsonl:{dir}/no_answers.jsonl"], "record 1 lacks the column 'answers' (or kvpress's 'answer')"),
    (["--task", "jsonl:{dir}/no_tokens.jsonl"], "lacks the column 'max_new_tokens' (or give --task-arg"),
    (["--task", "jsonl:{dir}/half_tasks.jsonl"], "record 2 has no 'task' while others have one"),
    (["--task", "jsonl:{dir}/empty.jsonl"], "empty.jsonl holds no records"),
    (["--task", "jsonl:{dir}/unknown.jsonl"], "cannot tell the format from the columns of record 1 (prompt, target)"),
    (["--task", "jsonl:{dir}/two_datasets.jsonl"], "records of several LongBench datasets (hotpotqa, trec)"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--format", "ruler"], "record 1 lacks the column 'input'"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--format", "csv"], "unknown format 'csv'; choose from auto, kvpress"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--metric", "bleu"], "unknown metric 'bleu'; choose from"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--metric", "classification"], "metric classification needs"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--offset", "4"], "offset 4 is past the end of"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--limit", "0"], "limit must be >= 1, got 0"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--samples", "2"], "--samples is not for data tasks"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--task-arg", "depth=3"], "data tasks take --task-arg max_new_tokens=N only"),
    (["--task", "jsonl:{dir}/kv.jsonl", "--task-arg", "max_new_tokens=x"], "max_new_tokens must be an integer"),
    (["--task", "{dir}/kv.jsonl"], "unknown task '{dir}/kv.jsonl'; for your data file use --task jsonl:{dir}/kv.jsonl"),
    (["--metric", "exact"], "--metric is for data tasks (jsonl:PATH, hf:NAME[:CONFIG]:SPLIT), not ruler:"),
    (["--limit", "3"], "--limit is for data tasks"),
    (["--task", "hf:someone/no-such-data:test"], "hf:someone/no-such-data:test: cannot load the dataset"),
    (["--task", "hf:only-a-name"], "a dataset task is hf:NAME[:CONFIG]:SPLIT, got 'hf:only-a-name'"),
])
def test_bad_data_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, capsys, tmp_path, args, message):
    from evalkit import runner

    def no_model(*args, **kwargs):
        raise AssertionError("bad data must be refused before the model loads")

    monkeypatch.setattr(runner, "load_model", no_model)
    bad_files(tmp_path)
    out = tmp_path / "runs"
    args = [arg.format(dir=tmp_path) for arg in args]
    code, _, err = evalkit(monkeypatch, capsys, "run", *args, "--out", str(out), "--wandb", "off")
    assert code == 2
    assert message.format(dir=tmp_path) in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def read_run(out):
    (run_dir,) = out.iterdir()
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return run_dir, records, json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_end_to_end_on_a_jsonl_file_with_sub_tasks(monkeypatch, capsys, tmp_path):
    path = write_jsonl(tmp_path / "doors_and_cities.jsonl", KVPRESS)
    out = tmp_path / "full"
    code, stdout, _ = evalkit(monkeypatch, capsys, "run", "--task", f"jsonl:{path}", "--policy", "full",
                              "--budget", "1", "--out", str(out), "--wandb", "off")
    assert code == 0, stdout
    run_dir, records, metrics = read_run(out)
    assert run_dir.name.startswith("doors_and_cities-full-1.0-")
    assert [r["id"] for r in records] == [r["id"] for r in KVPRESS]
    assert [r["references"] for r in records] == [["4817"], ["9052"], ["Lisbon"], ["Oslo"]]
    for r in records:  # RULER's string_match_all with one reference: found in the prediction, ignoring case
        assert r["score"] == float(r["references"][0].lower() in r["prediction"].lower())
    assert set(metrics["by_task"]) == {"codes", "cities"}
    assert metrics["by_task"]["codes"] == (records[0]["score"] + records[1]["score"]) / 2
    assert metrics["score"] == (metrics["by_task"]["codes"] + metrics["by_task"]["cities"]) / 2
    assert "cities" in stdout and "codes" in stdout
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["data_format"], config["question_split"], config["samples"]) == ("kvpress", True, 4)

    # A slice, compressed before the question is seen.
    out = tmp_path / "agnostic"
    code, _, _ = evalkit(monkeypatch, capsys, "run", "--task", f"jsonl:{path}", "--policy", "snapkv_head",
                         "--budget", "0.5", "--query-agnostic", "--offset", "1", "--limit", "2",
                         "--out", str(out), "--wandb", "off", "--no-baseline")
    assert code == 0
    _, records, metrics = read_run(out)
    assert [r["id"] for r in records] == ["code-b", "city-a"]
    assert set(metrics["by_task"]) == {"codes", "cities"}
    assert all(r["kept_tokens"] < r["prompt_tokens"] for r in records)


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_a_sample_over_the_length_is_refused_after_tokenising(monkeypatch, capsys, tmp_path):
    path = write_jsonl(tmp_path / "kv.jsonl", KVPRESS)
    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, "run", "--task", f"jsonl:{path}", "--length", "40",
                           "--out", str(out), "--wandb", "off")
    assert code == 2 and "4 of 4 samples need more than --length 40 tokens" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.model  # a data task's RunConfig checks its records against the default model's window
def test_a_record_over_the_models_window_is_refused_once_tokenised(monkeypatch, capsys, tmp_path):
    """Data samples are never cut: one that fits --length but not the model's positions is refused."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from conftest import TINY
    from evalkit.assets import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**dict(TINY, vocab_size=len(tokenizer),
                                                                max_position_embeddings=40)))
    folder = tmp_path / "tiny-40"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    capsys.readouterr()  # saving's progress bars are not the run's output
    path = write_jsonl(tmp_path / "kv.jsonl", KVPRESS)
    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, "run", "--task", f"jsonl:{path}", "--model", str(folder),
                           "--length", "2048", "--out", str(out), "--wandb", "off")
    assert code == 2 and "sample code-a needs" in err and f"{folder} has 40: lower the record" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.model  # `evalkit run` on the default model
def test_a_run_and_its_baseline_read_the_data_once(monkeypatch, capsys, tmp_path):
    """Validation makes the task (the records read and hashed) and the policy once; the runner and the baseline
    use them as they are (`RunConfig.resolve`, `ResolvedRun.full_cache`)."""
    import evalkit.tasks.custom as custom
    from evalkit.policies import names

    path = write_jsonl(tmp_path / "doors_and_cities.jsonl", KVPRESS)
    made = {"tasks": 0, "policies": 0}
    task_init, policy_made = custom.DataTask.__init__, names.make_policy

    def counted_task(self, *args, **kwargs):
        made["tasks"] += 1
        task_init(self, *args, **kwargs)

    def counted_policy(*args, **kwargs):
        made["policies"] += 1
        return policy_made(*args, **kwargs)

    monkeypatch.setattr(custom.DataTask, "__init__", counted_task)
    monkeypatch.setattr("evalkit.config.make_policy", counted_policy)
    code, stdout, _ = evalkit(monkeypatch, capsys, "run", "--task", f"jsonl:{path}", "--policy", "snapkv_head",
                              "--budget", "0.5", "--limit", "2", "--out", str(tmp_path / "runs"), "--wandb", "off")
    assert code == 0, stdout
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "runs").iterdir()) == ["full", "snapkv_head"]
    assert made == {"tasks": 1, "policies": 2}  # the run's policy, and its baseline's `full`
