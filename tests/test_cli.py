"""The command line: bad input is one line and exit code 2 with nothing written; a real run on the default model."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import evalkit, read_run

SHORT = ["--length", "600", "--samples", "3"]


@pytest.mark.parametrize("args, message", [
    (["--policy", "h2o_haed"], "unknown policy 'h2o_haed' (did you mean 'h2o_head'?)"),
    (["--task", "ruler:nope"], "unknown task 'ruler:nope'"),
    (["--granularity", "row"], "unknown granularity 'row'"),
    (["--layout", "sparse"], "unknown layout 'sparse'"),
    (["--budget", "0"], "budget must be > 0"),
    (["--budget", "-0.5"], "out of range"),
    (["--budget", "1.5"], "out of range"),
    (["--budget", "2.0"], "out of range"),
    (["--budget", "12.5"], "out of range"),
    (["--budget", "lots"], "budget must be a fraction"),
    (["--block-size", "0"], "block-size must be >= 1"),
    (["--samples", "none"], "Invalid value for '--samples'"),
    (["--model", "./no/such/model"], "model path './no/such/model' does not exist"),
    pytest.param(["--length", "9000"], "has 8192", marks=pytest.mark.model),  # the default model's positions
    pytest.param(["--length", "300", "--pool-pages", "4"], "KV page pool exhausted: asked for",
                 marks=pytest.mark.model),  # the pool's pages sized from the default model's shape (config.json)
    (["--task-arg", "depths"], "task-arg must be KEY=VALUE, got 'depths'"),
    (["--kernels", "cuda"], "unknown kernels 'cuda'; choose from auto, triton, torch"),
    (["--task-arg", "depths=0,50"], "task ruler:niah_single_2 takes no --task-arg settings, got depths"),
    (["--task", "multiturn_niah", "--task-arg", "turns=0"], "turns must be a whole number from 1 to 64, got '0'"),
    (["--task", "multiturn_kv", "--task-arg", "turns=20", "--length", "900"],
     "--length 900 leaves no room for a prompt: 20 turns take 960 new tokens (48 each)"),
    pytest.param(["--task", "multiturn_niah", "--length", "9000"], "has 8192",  # every turn and answer within them
                 marks=pytest.mark.model),
    (["--policy", "quest", "--granularity", "head_page"], "quest cannot run at granularity head_page: Quest"),
    (["--policy", "adakv", "--granularity", "head_page"], "adakv_snapkv cannot run at granularity head_page"),
    (["--policy", "h2o_token", "--granularity", "head"], "--granularity head contradicts it: use --policy h2o_head"),
    (["--policy", "h2o_head_page", "--budget", "12"], "at granularity head_page the smallest budget is 16 tokens"),
    (["--policy", "h2o_page", "--budget", "0.005"], "at granularity page the smallest budget is 16 tokens"),
    (["--policy", "snapkv", "--policy-arg", "kernel=4"], "kernel an odd number"),
    (["--policy", "snapkv", "--policy-arg", "windw=64"], "snapkv_head has no policy-arg 'windw'"),
    (["--policy", "h2o", "--policy-arg", "normalize=maybe"], "policy-arg normalize must be bool"),
])
def test_bad_input_is_one_line_and_exit_2_with_no_run_folder(monkeypatch, capsys, tmp_path, args, message):
    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, "run", *args, "--out", str(out), "--wandb", "off")
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow  # a second Python that imports torch
def test_console_script_reports_bad_input_without_traceback(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "evalkit"), "run", "--budget", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: budget must be > 0, got 0"


def test_listings_name_every_policy_and_task(monkeypatch, capsys):
    from evalkit.policies import POLICIES
    from evalkit.tasks import TASKS

    code, out, _ = evalkit(monkeypatch, capsys, "policies")
    assert code == 0 and all(name in out for name in POLICIES.names()) and "h2o_block1" in out
    assert "bandwidth" in out and "memory" in out and "arXiv:2404.14469" in out
    code, out, _ = evalkit(monkeypatch, capsys, "tasks")
    assert code == 0 and all(name in out for name in TASKS.names())


def test_no_policy_says_a_sentence_twice_in_what_differs_from_its_paper():
    from evalkit.cli import differs_from_the_paper
    from evalkit.policies import POLICIES

    for name in POLICIES.names():
        sentences = [s.strip() for s in re.split(r"[;.] ", differs_from_the_paper(POLICIES.create(name)))]
        assert len(sentences) == len(set(sentences)), name
    assert differs_from_the_paper(POLICIES.create("duo_attention")).count("its own role") == 1


@pytest.mark.model  # runs the default model
def test_end_to_end_on_the_default_model(monkeypatch, capsys, tmp_path):
    out = tmp_path / "runs"
    code, stdout, _ = evalkit(monkeypatch, capsys, "run", "--policy", "full", "--budget", "1.0", *SHORT,
                              "--out", str(out), "--wandb", "off")
    assert code == 0
    _, full_records, full = read_run(out, "full")
    assert len(full_records) == 3
    assert full["score"] == 1.0  # the default model finds every needle with the whole cache
    assert all(r["kept_tokens"] == r["prompt_tokens"] for r in full_records)

    monkeypatch.delenv("WANDB_MODE", raising=False)
    code, stdout, _ = evalkit(monkeypatch, capsys, "run", "--policy", "h2o_head", "--budget", "0.2", *SHORT,
                              "--out", str(out), "--wandb", "offline")
    assert code == 0
    assert "100.0" in stdout  # the full-cache score, found on disk and shown beside this one
    run_dir, records, metrics = read_run(out, "h2o_head")
    assert len(records) == 3 and 0.0 <= metrics["score"] <= 1.0
    for r in records:
        # 20% of the prompt per head, the question included (query-aware): ceil(0.2 * prompt).
        assert r["kept_tokens"] == -(-r["prompt_tokens"] * 2 // 10)
        assert r["bytes_ideal"] <= r["bytes_held"] < 0.3 * r["bytes_full"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["budget"] == 0.2 and config["versions"]["torch"].startswith("2.13")
    assert list((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.model  # runs the default model
def test_an_interrupted_run_resumes_without_losing_or_repeating_samples(monkeypatch, capsys, tmp_path):
    out = tmp_path / "runs"
    args = ["run", "--policy", "streaming_llm", "--budget", "0.3", *SHORT, "--out", str(out), "--wandb", "off"]
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    run_dir, records, metrics = read_run(out, "streaming_llm")
    # What a kill in the middle of the second sample leaves: one whole line, one torn line, no metrics.
    lines = (run_dir / "predictions.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "predictions.jsonl").write_text(lines[0] + lines[1][:40])
    (run_dir / "metrics.json").unlink()

    code, stdout, _ = evalkit(monkeypatch, capsys, *args)
    assert code == 0 and "resumed after 1 samples" in stdout
    _, resumed, resumed_metrics = read_run(out, "streaming_llm")
    assert [r["id"] for r in resumed] == [r["id"] for r in records]
    assert [r["prediction"] for r in resumed] == [r["prediction"] for r in records]
    assert resumed_metrics["score"] == metrics["score"]

    code, stdout, _ = evalkit(monkeypatch, capsys, *args)
    assert code == 0 and "already complete" in stdout


def test_group_tasks_score_the_mean_of_their_tasks():
    from evalkit.evaluations import aggregate

    base = dict(kept_tokens=10, prompt_tokens=20, bytes_held=8, bytes_ideal=8, bytes_full=16,
                attended_fraction=1.0, new_tokens=2, prefill_seconds=1.0, decode_seconds=1.0)
    records = [dict(base, score=1.0, meta={"task": "a"}), dict(base, score=0.0, meta={"task": "a"}),
               dict(base, score=0.0, meta={"task": "a"}), dict(base, score=1.0, meta={"task": "b"})]
    metrics = aggregate(records)
    assert metrics["by_task"] == {"a": 1 / 3, "b": 1.0}
    assert metrics["score"] == (1 / 3 + 1.0) / 2  # not the mean over samples (0.5)
    assert aggregate([dict(base, score=0.5, meta={})])["score"] == 0.5
