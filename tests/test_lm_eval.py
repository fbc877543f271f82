"""The lm-eval adapter: lm-eval's own HF model at budget 1, real compression under a small budget,
bad model args refused before any model is loaded, and the CLI entry writing a runs/ folder.

Local tasks only (YAML with `dataset_path: json`), written to pytest's tmp folders: all offline.
"""

import json
import math

import pytest
import torch

from conftest import tiny_model
from evalkit import models
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.loop.teacher_forcing import ScoreRequest, score_continuations, score_rolling
from evalkit.integrations.lm_eval import EvalkitLM
from evalkit.integrations.lm_eval_command import main, save_run
from evalkit.policies import make_policy

MAX_LENGTH = 48  # small, so rolling perplexity spans several of lm-eval's windows
TASKS = ["ek_mc", "ek_gen", "ek_ppl"]
MC = [
    {"question": "Paris is the capital and largest city of France. The city is known for its museums. "
                 "Question: what is the capital of France? Answer:",
     "choices": [" Paris", " Berlin", " a large green frog"], "label": 0},
    {"question": "Tom had three apples and ate one of them after lunch. Question: how many apples are left? Answer:",
     "choices": [" two", " seven apples"], "label": 0},
]
GEN = [{"question": "Anna lives in Rome, the capital of Italy. In which city does Anna live?", "answer": "Rome"},
       {"question": "What color is the sky on a clear day?", "answer": "blue"}]
PPL = [{"text": "It is a truth universally acknowledged, that a single man in possession of a good fortune, must "
                "be in want of a wife. However little known the feelings or views of such a man may be on his first "
                "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families."},
       {"text": "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox."}]


N_REQUESTS = sum(len(doc["choices"]) for doc in MC) + len(GEN) + len(PPL)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, rows in (("mc", MC), ("gen", GEN), ("ppl", PPL)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def head(name):
        return (f"task: ek_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {folder / name}.jsonl\ntest_split: test\n")

    (folder / "mc.yaml").write_text(head("mc") + (
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n'
        '    higher_is_better: true\n'))
    (folder / "gen.yaml").write_text(head("gen") + (
        'output_type: generate_until\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n'
        '  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n'
        '    higher_is_better: true\n'))
    (folder / "ppl.yaml").write_text(head("ppl") + (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        'metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n'
        '    higher_is_better: false\n'))
    return folder


def evaluate(lm, task_manager):
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=TASKS, task_manager=task_manager, log_samples=True, verbosity="ERROR")


def responses(results) -> dict:
    """{(task, doc_id, choice): raw response} from lm-eval's logged samples."""
    found = {}
    for task in TASKS:
        for sample in results["samples"][task]:
            for i, response in enumerate(sample["resps"]):
                found[task, sample["doc_id"], i] = response[0]
    return found


@pytest.fixture(scope="module")
def full_budget(default_model, task_dir):
    """lm-eval's own HF model and the adapter at budget 1, on the same loaded model."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval.tasks import TaskManager

    model, tokenizer = default_model
    tasks = TaskManager(include_path=str(task_dir))  # indexing lm-eval's tasks takes seconds: once
    hf = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, max_length=MAX_LENGTH, batch_size=1), tasks)
    ek = evaluate(EvalkitLM(pretrained=model, tokenizer=tokenizer, policy="h2o_head", budget=1.0,
                            max_length=MAX_LENGTH, batch_size=2), tasks)
    return hf, ek


@pytest.mark.model  # default_model loads the default model
def test_budget_one_equals_lm_eval_hf_model(full_budget):
    hf, ek = full_budget
    expected, got = responses(hf), responses(ek)
    assert expected.keys() == got.keys() and len(expected) == N_REQUESTS
    worst = 0.0
    for key, want in expected.items():
        task = key[0]
        if task == "ek_gen":
            assert got[key] == want, key
        elif task == "ek_mc":
            assert got[key][1] == want[1], key  # is-greedy
            worst = max(worst, abs(got[key][0] - want[0]))
        else:
            worst = max(worst, abs(got[key] - want))
    print(f"max |loglikelihood difference| against HFLM: {worst:.2e} over {len(expected)} requests")
    assert worst < 1e-4, worst
    # The generation task really generated, and stopped at a stop sequence or max_gen_toks.
    assert any(got["ek_gen", d, 0].strip() for d in range(len(GEN)))
    assert all("\n" not in got["ek_gen", d, 0] for d in range(len(GEN)))
    # Each request recorded with its kept tokens: at budget 1 the whole prompt.
    records = ek["config"]["evalkit"]["predictions"]
    assert len(records) == N_REQUESTS
    assert all(r["kept_tokens"] == r["prompt_tokens"] for r in records if r["type"] != "loglikelihood_rolling")


@pytest.mark.model  # default_model loads the default model
def test_save_run_writes_simple_evaluate_results_to_runs(full_budget, tmp_path, monkeypatch):
    hf, ek = full_budget
    monkeypatch.setenv("WANDB_MODE", "offline")  # mirrored to W&B like any evalkit run
    folder = save_run(ek, tmp_path)
    assert list((folder / "wandb").glob("offline-run-*"))
    assert folder.parent == tmp_path and folder.name.startswith("lm_eval-ek_gen+2-h2o_head-1.0-")
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["ek_mc/acc,none"] == ek["results"]["ek_mc"]["acc,none"]
    assert metrics["kept_over_prompt"] > 0.99 and metrics["requests"] == N_REQUESTS
    assert len((folder / "predictions.jsonl").read_text().splitlines()) == N_REQUESTS
    with pytest.raises(EvalkitError, match="do not come from --model evalkit"):
        save_run(hf, tmp_path)


@pytest.fixture(scope="module")
def sparse_cli_run(default_model, task_dir, tmp_path_factory):
    """`evalkit lm-eval` at a small budget, through lm-eval's own CLI: (exit code, run folder)."""
    out = tmp_path_factory.mktemp("runs")
    code = main(["--model_args", f"policy=h2o_head,budget=0.25,chunk_size=16,max_length={MAX_LENGTH},batch_size=4",
                 "--tasks", ",".join(TASKS), "--include_path", str(task_dir), "--out", str(out),
                 "--verbosity", "ERROR"])
    folders = list(out.iterdir())
    return code, folders


@pytest.mark.model  # default_model loads the default model
def test_cli_entry_runs_lm_eval_and_writes_a_run_folder(sparse_cli_run):
    code, folders = sparse_cli_run
    assert code == 0 and len(folders) == 1
    folder = folders[0]
    assert folder.name.startswith("lm_eval-ek_gen+2-h2o_head-0.25-")
    config = json.loads((folder / "config.json").read_text())
    assert config["config"]["policy"] == "h2o_head" and config["config"]["budget"] == 0.25
    assert config["tasks"] == sorted(TASKS) and config["versions"]["lm_eval"]
    metrics = json.loads((folder / "metrics.json").read_text())
    for key in ("ek_mc/acc,none", "ek_gen/exact_match,none", "ek_ppl/word_perplexity,none", "kept_tokens",
                "bytes_held", "held_over_full"):
        assert key in metrics, key
    records = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == metrics["requests"] == N_REQUESTS
    assert {r["type"] for r in records} == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    assert all(len(r["id"]) == 12 and r["task"] in TASKS for r in records)


@pytest.mark.model  # default_model loads the default model
def test_small_budget_compresses_and_changes_the_numbers(sparse_cli_run, full_budget):
    _, folders = sparse_cli_run
    records = [json.loads(line) for line in (folders[0] / "predictions.jsonl").read_text().splitlines()]
    # The context really was compressed: kept tokens recorded, well below the prompt.
    assert all(r["kept_tokens"] <= math.ceil(0.25 * r["prompt_tokens"]) + 1 < r["prompt_tokens"] for r in records)
    expected = responses(full_budget[0])
    changed = 0
    for r in records:
        if r["type"] == "loglikelihood":
            value, want = r["result"][0], expected[r["task"], r["doc_id"], r["idx"]][0]
        elif r["type"] == "loglikelihood_rolling":
            value, want = r["result"], expected[r["task"], r["doc_id"], 0]
        else:
            assert isinstance(r["result"], str)
            continue
        assert math.isfinite(value) and value < 0
        changed += abs(value - want) > 1e-3
    assert changed >= N_REQUESTS - len(GEN) - 1  # of the scored requests


@pytest.mark.parametrize("args, message", [
    ("policy=nope", "unknown policy 'nope'"),
    ("policy=h2o_head,budget=1.5", "budget 1.5 is out of range"),
    ("budget=0", "budget must be > 0"),
    ("polcy=h2o_head", "unknown model arg 'polcy'.*did you mean 'policy'"),
    ("layout=sparse", "unknown layout 'sparse'"),
    ("kernels=cuda", "unknown kernels 'cuda'"),
    ("batch_size=auto", "batch_size must be an integer"),
])
def test_bad_model_args_fail_before_any_model_is_loaded(monkeypatch, task_dir, args, message):
    from lm_eval import simple_evaluate
    from transformers import AutoModelForCausalLM

    def refuse(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(EvalkitError, match=message) as error:
        simple_evaluate(model="evalkit", model_args=args, tasks=["ek_mc"], verbosity="ERROR")
    assert "\n" not in str(error.value)


def test_cli_entry_refuses_bad_model_args_with_one_line(monkeypatch, task_dir, capsys):
    monkeypatch.setattr(models, "load_model", lambda *_, **__: pytest.fail("a model was loaded"))
    code = main(["--model_args", "policy=h2o_head,budget=2.5", "--tasks", "ek_mc", "--include_path", str(task_dir),
                 "--verbosity", "ERROR"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: budget 2.5 is out of range")


@pytest.fixture
def lm_eval_logs_here(monkeypatch):
    """lm-eval's log handler made afresh on this test's stderr: lm-eval makes it once per process, on the
    stderr of that moment, so that its lines would otherwise never reach capsys."""
    import logging

    from lm_eval import utils

    monkeypatch.setattr(utils, "_LOGGING_CONFIGURED", False)
    monkeypatch.setattr(logging.getLogger("lm_eval"), "handlers", [])


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model fails the test; fetching and converting the default model (`default_model_dir`) too,
    unless the test allows it (a task that exists may need the default's tokenizer to build its data)."""
    from transformers import AutoModelForCausalLM

    from evalkit import assets

    allowed, real = [], assets.default_model_dir

    def refuse(*_, **__):
        raise AssertionError("the model loader was called")

    monkeypatch.setattr(assets, "default_model_dir", lambda: real() if any(allowed) else refuse())
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    return allowed


@pytest.mark.parametrize("args, message", [
    # slow: lm-eval builds its index of every task it knows (4-5 s) to say one is unknown
    pytest.param(["--tasks", "no_such_task_xyz", "--limit", "2"], "lm-eval: Tasks not found: no_such_task_xyz",
                 marks=pytest.mark.slow),
    # a hub task, offline (conftest): its data loads, and fails, after the default model's folder is made
    pytest.param(["--tasks", "hellaswag", "--limit", "2"],
                 "cannot load lm-eval tasks hellaswag: ConnectionError: Couldn't reach 'Rowan/hellaswag' on the Hub",
                 marks=pytest.mark.model),
    (["--tasks", "ek_mc", "--limit", "-1"], "lm-eval: --limit must be a number > 0 (examples per task, or a "
                                            "fraction of them below 1), got '-1'"),
    (["--tasks", "ek_mc", "--limit=-0.5"], "got '-0.5'"),
    (["--tasks", "ek_mc", "-L", "nan"], "got 'nan'"),
    (["--tasks", "ek_mc", "--include_path", "{tmp}/missing", "--limit", "2"],
     "lm-eval: --include_path {tmp}/missing is not a folder (of task YAML files)"),
    (["--tasks", "ek_mc", "--include_path", "{tmp}/file.yaml"], "--include_path {tmp}/file.yaml is not a folder"),
])
def test_lm_eval_refusals_are_one_line_and_load_no_model(lm_eval_logs_here, no_model_loads, capsys, tmp_path,
                                                          args, message):
    """Issue #34: lm-eval's own WARNING lines came before the error; `--limit -1` passed; a missing task was
    refused only after the default model had been fetched and converted (99 s on a fresh machine)."""
    (tmp_path / "file.yaml").write_text("task: x\n")
    no_model_loads.append("hellaswag" in args)  # the one task here that exists
    code = main([arg.format(tmp=tmp_path) for arg in args] + ["--out", str(tmp_path / "runs"), "--wandb", "off"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [err.splitlines()[0]] and err.startswith("error: "), err
    assert message.format(tmp=tmp_path) in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.model  # the default model's tokenizer folder
def test_lm_eval_log_lines_come_through_once_the_tasks_have_loaded(lm_eval_logs_here, monkeypatch, capsys,
                                                                    task_dir, tmp_path):
    """Held while lm-eval checks its input, not dropped: a run that passes still shows them."""
    from lm_eval import evaluator

    seen = []
    monkeypatch.setattr(evaluator, "simple_evaluate", lambda *_, **kwargs: seen.append(kwargs["tasks"]))
    code = main(["--tasks", "ek_mc", "--include_path", str(task_dir), "--limit", "1", "--out", str(tmp_path),
                 "--wandb", "off"])
    err = capsys.readouterr().err
    assert code == 0 and len(seen) == 1 and seen[0][0].config.task == "ek_mc"  # built before the model
    assert err.count("--limit SHOULD ONLY BE USED FOR TESTING") == 1 and "Selected Tasks: ['ek_mc']" in err


@pytest.mark.model  # default_model loads the default model
def test_the_default_model_folder_is_where_assets_makes_it(default_model):
    from evalkit.assets import default_model_dir
    from evalkit.integrations.lm_eval_options import default_model_folder

    assert default_model_folder() == default_model_dir()


@pytest.mark.model  # default_model loads the default model
def test_query_agnostic_compresses_the_context_and_appends_the_question(default_model):
    from lm_eval.api.instance import Instance

    model, tokenizer = default_model
    context = MC[0]["question"].replace(" Question:", "\nQuestion:")
    request = Instance("loglikelihood", doc={}, arguments=(context, " Paris"), idx=0, metadata=("t", 0, 1))
    kept = {}
    for aware in (True, False):
        lm = EvalkitLM(pretrained=model, tokenizer=tokenizer, policy="h2o_head", budget=0.25, query_aware=aware)
        (logprob, _), = lm.loglikelihood([request])
        assert math.isfinite(logprob)
        record, = lm.records
        kept[aware] = record["kept_tokens"]
        prompt = record["prompt_tokens"]
    question = len(tokenizer.encode("\nQuestion: what is the capital of France? Answer:"))
    assert kept[True] == math.ceil(0.25 * prompt)
    # Query-agnostic: a quarter of the context is kept, and the question comes on top, never evicted.
    assert kept[False] == math.ceil(0.25 * (prompt - question)) + question


# The teacher-forcing functions of the loop, on a tiny model.

def tiny_prompts(lengths=(30, 21)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("decode_eviction", [True, False])
def test_teacher_forcing_through_the_sparse_cache_reproduces_greedy_decoding(decode_eviction):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompts = tiny_prompts()
    settings = GenerationSettings(make_policy("h2o_head"), budget=0.3, page_size=4, decode_eviction=decode_eviction)
    gens = generate(model, None, [Request(p, [], 6) for p in prompts], settings)
    scores = score_continuations(model, [ScoreRequest(p, [], g.token_ids) for p, g in zip(prompts, gens)], settings)
    for gen, score in zip(gens, scores):
        assert score.greedy and len(score.logprobs) == 6  # the decoded answer is the argmax at every step
        assert score.kept_tokens == gen.kept_tokens < gen.prompt_tokens


def test_scores_at_budget_one_equal_a_full_forward_and_shared_prompts_share_a_pass():
    model = tiny_model("llama")
    prompt, = tiny_prompts((25,))
    answers = [[5, 9, 17], [5, 9, 40], [7]]
    settings = GenerationSettings(make_policy("h2o_head"), budget=1.0, page_size=4)
    forwards = []
    scores = score_continuations(model, [ScoreRequest(prompt[:20], prompt[20:], a) for a in answers], settings,
                                 observe=lambda event, cache: forwards.append(event))
    assert forwards.count("forward") == 2  # one prefill and one continuation pass for all three answers
    for answer, score in zip(answers, scores):
        ids = torch.tensor([prompt + answer])
        want = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        want = want.gather(1, torch.tensor(answer)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(score.logprobs), want, atol=1e-5)


def test_rolling_scores_stream_in_chunks_and_stay_within_budget_plus_chunk():
    model = tiny_model("llama")
    sequence, = tiny_prompts((41,))
    full = torch.log_softmax(model(torch.tensor([sequence])).logits[0, :-1].float(), -1)
    want = full.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
    dense = GenerationSettings(make_policy("h2o_head"), budget=1.0, page_size=4, chunk_size=8)
    score, = score_rolling(model, [sequence], [40], dense)
    assert torch.allclose(torch.tensor(score.logprobs), want, atol=1e-5)
    tail, = score_rolling(model, [sequence], [7], dense)
    assert torch.allclose(torch.tensor(tail.logprobs), want[-7:], atol=1e-5)

    peaks = []
    sparse = GenerationSettings(make_policy("h2o_head"), budget=0.25, page_size=4, chunk_size=8)
    score, = score_rolling(model, [sequence], [40], sparse,
                           observe=lambda event, cache: peaks.append(int(cache.kept_tokens().max())))
    assert max(peaks) <= math.ceil(0.25 * 40) + 8 and score.kept_tokens == math.ceil(0.25 * 40)
    got = torch.tensor(score.logprobs)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[:8], want[:8], atol=1e-5)  # the first chunk saw everything: nothing evicted yet
    assert not torch.allclose(got, want, atol=1e-3)
