"""`evalkit compare`: two run folders (written here by hand) compared sample by sample."""

import json

import pytest
from scipy import stats

from helpers import evalkit

BASE = {"task": "ruler:niah_single_2", "task_args": {}, "length": 512, "samples": 20, "model": "m", "seed": 0,
        "temperature": 0.0, "dtype": "auto", "layout": "paged", "query_aware": True, "granularity": None,
        "block_size": 16, "prefill": "full", "chunk_size": 512, "decode_eviction": True, "pool_pages": None,
        "policy_args": {}, "data_sha256": None, "data_format": None, "metric": None, "offset": None}


def write_run(root, run_id, scores, complete=True, ids=None, **config):
    folder = root / run_id
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": {**BASE, **config}, "run_id": run_id}))
    ids = ids or [f"s{i}" for i in range(len(scores))]
    (folder / "predictions.jsonl").write_text("".join(json.dumps({"id": i, "score": float(s)}) + "\n"
                                                      for i, s in zip(ids, scores)))
    if complete:
        (folder / "metrics.json").write_text(json.dumps({"score": sum(scores) / max(1, len(scores)),
                                                         "samples": len(scores)}))
    return folder


def edited(folder, **metrics):
    """A run whose metrics.json was changed after the run."""
    path = folder / "metrics.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **metrics}))


def torn(folder):
    """A run whose predictions.jsonl gained half a line after the run."""
    with open(folder / "predictions.jsonl", "a") as file:
        file.write('{"id": "s0"')


A = [1] * 16 + [0] * 4  # 80 %
B = [1] * 2 + [0] * 18  # 10 %: A passes 14 samples B fails, B none that A fails


def test_compare_prints_the_paired_difference_and_a_verdict(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, "a-snapkv_head_page", A, policy="snapkv_head_page", budget=0.1)
    write_run(tmp_path, "b-snapkv_token", B, policy="snapkv_token", budget=0.1)
    code, out, err = evalkit(monkeypatch, capsys, "compare", "a-snapkv_head_page", "b-snapkv_token",
                             "--runs", str(tmp_path))
    assert code == 0, err
    p = stats.binomtest(14, 14).pvalue
    lines = out.splitlines()
    assert lines[0].startswith("A  a-snapkv_head_page  score 80.0 [")
    assert "A − B: +70.0 [" in lines[2] and f"(Newcombe); exact McNemar p = {p:.3g}" in lines[2]
    assert "only A better on 14, only B on 0 of 20 samples" in lines[2]
    assert lines[3] == f"A better, p = {p:.3g}"
    code, out, _ = evalkit(monkeypatch, capsys, "compare", str(tmp_path / "b-snapkv_token"),
                           str(tmp_path / "a-snapkv_head_page"), "--json")
    result = json.loads(out)
    assert code == 0 and result["verdict"] == f"B better, p = {p:.3g}" and result["p_value"] == pytest.approx(p)
    assert result["a"]["ci_method"] == "wilson" and result["difference"] == pytest.approx(-0.7)
    assert result["interval"] == "Newcombe" and result["ci_low"] < -0.7 < result["ci_high"]


def test_compare_with_the_baseline_finds_the_full_run(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, "x-h2o_head", [1] * 9 + [0] * 11, policy="h2o_head", budget=0.2)
    write_run(tmp_path, "x-full-dense", [1] * 19 + [0], policy="full", budget=1.0, layout="dense")
    write_run(tmp_path, "x-full", [1] * 20, policy="full", budget=1.0)  # ran most alike: the same layout
    code, out, err = evalkit(monkeypatch, capsys, "compare", "x-h2o_head", "--baseline", "--runs", str(tmp_path),
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["b"]["run"] == "x-full" and result["only_b"] == 11 and result["only_a"] == 0


def test_a_difference_too_small_to_see_says_how_many_samples_would_do(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, "a", [1] * 3 + [0] * 17, policy="h2o_head", budget=0.2)
    write_run(tmp_path, "b", [0, 1, 1] + [0] * 16 + [1], policy="h2o_token", budget=0.2)
    code, out, _ = evalkit(monkeypatch, capsys, "compare", "a", "b", "--runs", str(tmp_path), "--detect", "20")
    assert code == 0
    assert out.splitlines()[-1].startswith("no difference detected at n = 20 (p = ")
    assert out.splitlines()[-1].endswith("samples to detect a 20-point difference")


@pytest.mark.parametrize("make, args, message", [
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                write_run(r, "b", A, policy="h2o_head", budget=0.2, task="ruler:niah_multikey_1")),
     ["a", "b"], "the runs differ in task"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                write_run(r, "b", A, policy="h2o_head", budget=0.2, length=1024)),
     ["a", "b"], "the runs differ in length"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                write_run(r, "b", A, ids=[f"t{i}" for i in range(20)], policy="h2o_head", budget=0.2)),
     ["a", "b"], "the runs hold different samples"),
    (lambda r: (write_run(r, "a", [], policy="h2o_head", budget=0.2),
                write_run(r, "b", A, policy="h2o_head", budget=0.2)),
     ["a", "b"], "run a has no samples"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                write_run(r, "b", A, complete=False, policy="h2o_head", budget=0.2)),
     ["a", "b"], "run b is not complete (20 samples recorded)"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                edited(write_run(r, "b", B, policy="h2o_head", budget=0.5), score=0.5)),
     ["a", "b"], "run b: metrics.json's score 0.5 is not its predictions' 0.1: the files disagree"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                torn(write_run(r, "b", B, policy="h2o_head", budget=0.5))),
     ["a", "b"], "predictions.jsonl ends in a torn line: the run's records are incomplete"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                write_run(r, "b", [1] + B, ids=["s0"] + [f"s{i}" for i in range(20)], policy="h2o_head",
                          budget=0.5)),
     ["a", "b"], "predictions.jsonl repeats 1 sample id(s)"),
    (lambda r: (write_run(r, "a", A, policy="h2o_head", budget=0.2),
                edited(write_run(r, "b", B, policy="h2o_head", budget=0.5), samples=25)),
     ["a", "b"], "run b: metrics.json counts 25 samples and predictions.jsonl holds 20: the files disagree"),
    (lambda r: write_run(r, "a", A, policy="h2o_head", budget=0.2), ["a", "missing"], "no run 'missing'"),
    (lambda r: write_run(r, "a", A, policy="h2o_head", budget=0.2), ["a", "--baseline"], "no full-cache baseline"),
    (lambda r: write_run(r, "a", A, policy="h2o_head", budget=0.2), ["a"], "give two runs, or one run and"),
    (lambda r: write_run(r, "a", A, policy="h2o_head", budget=0.2), ["a", "a", "--detect", "0"],
     "--detect must be in (0, 100)"),
])
def test_runs_that_cannot_be_compared_are_refused_in_one_line(tmp_path, monkeypatch, capsys, make, args, message):
    make(tmp_path)
    code, out, err = evalkit(monkeypatch, capsys, "compare", *args, "--runs", str(tmp_path))
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_metric_without_per_sample_values_is_refused(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, "a", A, policy="h2o_head", budget=0.2)
    folder = write_run(tmp_path, "b", A, policy="h2o_head", budget=0.2)
    (folder / "predictions.jsonl").write_text("".join(json.dumps({"id": f"s{i}"}) + "\n" for i in range(20)))
    code, _, err = evalkit(monkeypatch, capsys, "compare", "a", "b", "--runs", str(tmp_path))
    assert code == 2 and "run b has no per-sample scores to compare" in err


def test_the_report_marks_what_differs_from_the_baseline_and_between_granularities(tmp_path):
    import csv

    from evalkit.report.page import build_report

    runs = tmp_path / "runs"
    for run_id, scores, policy, budget in (("full", [1] * 20, "full", 1.0), ("hp", A, "h2o_head_page", 0.1),
                                           ("tok", B, "h2o_token", 0.1), ("snap", B, "snapkv_token", 0.1)):
        folder = write_run(runs, run_id, scores, policy=policy, budget=budget)
        metrics = json.loads((folder / "metrics.json").read_text())
        (folder / "metrics.json").write_text(json.dumps({**metrics, "held_over_full": budget, "bytes_held": 1.0}))
    build_report(runs, tmp_path / "report")
    rows = {r["run_id"]: r for r in csv.DictReader((tmp_path / "report" / "leaderboard.csv").open())}
    # h2o: 3 tests (each granularity against full, and one against the other), Holm-adjusted together.
    raw = sorted([stats.binomtest(4, 4).pvalue, stats.binomtest(0, 18).pvalue, stats.binomtest(14, 14).pvalue])
    assert rows["hp"]["significance"] == f"> h2o_token (p = {max(3 * raw[0], 2 * raw[1]):.2g})"
    assert rows["tok"]["significance"] == (f"≠ full (p = {3 * raw[0]:.2g}); < h2o_head_page "
                                           f"(p = {max(3 * raw[0], 2 * raw[1]):.2g})")
    assert float(rows["hp"]["p_vs_full"]) == pytest.approx(raw[2])  # the largest: Holm leaves it as it is
    assert rows["snap"]["significance"] == f"≠ full (p = {stats.binomtest(0, 18).pvalue:.2g})"  # a family alone
    assert rows["full"]["significance"] == ""
