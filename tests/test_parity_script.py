"""scripts/parity_kvpress.py's pure parts: arguments, cells and the agreement table (no kvpress, no model)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "parity_kvpress.py"


@pytest.fixture(scope="module")
def parity():
    spec = importlib.util.spec_from_file_location("parity_kvpress", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["parity_kvpress"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_defaults(parity):
    args = parity.parse_args([])
    assert args.samples == 20 and args.length == 2048 and args.keep == (0.5, 0.2)
    assert args.presses == parity.DEFAULT_PRESSES and args.tools == ("kvpress", "evalkit")
    assert Path(args.out).parts[-2:] == ("runs", "parity")


@pytest.mark.parametrize("argv, message", [
    (["--keep", "0"], "--keep values must be in (0, 1)"),
    (["--keep", "1"], "--keep values must be in (0, 1)"),
    (["--keep", "0.5,x"], "fractions in (0, 1)"),
    (["--keep", "0.5,0.5"], "given twice"),
    (["--presses", "snapkv,nope"], "unknown press 'nope'"),
    (["--tools", "vllm"], "--tools takes kvpress, evalkit or both"),
    (["--samples", "0"], "integer >= 1"),
    (["--threads", "two"], "integer >= 1"),
    (["--venv", str(_PATH.parent / "kv")], "inside the repository"),
    (["--kvpress-rules", "evalkit", "--presses", "lagkv,kvzip"], "changes kvpress's ScorerPress only, not kvzip"),
    (["--kvpress-rules", "evalkit"], "not none, adakv_expected_attention, chunkkv_snapkv, kvzip, duo_attention"),
])
def test_bad_arguments_are_one_line_and_exit_2(parity, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parity.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cells_and_ratios(parity):
    cells = parity.cells(("none", "snapkv", "tova_head"), (0.5, 0.2))
    # The full cache once, then every press at the first keep (whole rows early), then the next keep.
    assert [c.key for c in cells] == ["none-keep1", "snapkv-keep0.5", "tova_head-keep0.5",
                                      "snapkv-keep0.2", "tova_head-keep0.2"]
    assert [c.ratio for c in cells] == [0.0, 0.5, 0.5, 0.8, 0.8]  # kvpress's compression_ratio = 1 - keep
    assert [c.budget for c in cells] == ["1.0", "0.5", "0.5", "0.2", "0.2"]
    # The unmatched row is compared with kvpress's TOVA answers.
    assert cells[2].kvpress_key == "tova-keep0.5" and not cells[2].press.matched


def test_agreement_counts_pass_fail_per_sample(parity):
    kvpress = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.5}
    evalkit = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 1.0}  # e: not in kvpress, left out
    row = parity.agreement_row(kvpress, evalkit)
    assert row["samples"] == 4 and row["agree"] == 3 and row["agree_pct"] == 75.0
    assert row["disagree_ids"] == ["b"]  # 0.5 and 0.0 both fail
    assert row["kvpress_score"] == pytest.approx(62.5) and row["evalkit_score"] == pytest.approx(75.0)
    assert parity.agreement_row({}, evalkit)["agree_pct"] is None


def test_table_formats(parity):
    row = {"press": "tova_head", "keep": 0.2, "kvpress": "TOVAPress", "evalkit": "tova_head --budget 0.2",
           "matched": False, "samples": 20, "agree": 12, "agree_pct": 60.0, "kvpress_score": 40.0,
           "evalkit_score": 0.0, "same_answer": 9, "kvpress_seconds": 7.123, "evalkit_seconds": None}
    text = parity.format_text([row])
    assert "tova_head (unmatched)" in text and "12/20" in text and "9/20" in text and "7.12" in text
    assert text.splitlines()[1].rstrip().endswith("—")  # no evalkit timing
    markdown = parity.format_markdown([row]).splitlines()
    assert markdown[0].startswith("| press | keep |") and markdown[1].startswith("|---|")
    assert markdown[2].count("|") == markdown[0].count("|")


def test_wrapper_rows_and_labels(parity):
    presses = parity.PRESSES
    # The rows of issue #29, none with eager attention (kvpress's AdaKVPress asserts it is not eager).
    for name in ("expected_attention", "adakv_expected_attention", "keydiff", "lagkv", "critical_snapkv",
                 "chunkkv_snapkv"):
        assert name in parity.DEFAULT_PRESSES and presses[name].matched and not presses[name].eager
    assert presses["adakv_expected_attention"].kvpress_label == "AdaKVPress(ExpectedAttentionPress)"
    assert presses["critical_snapkv"].kvpress_label == "CriticalKVPress(SnapKVPress(window_size=64, kernel_size=5))"
    chunk = presses["chunkkv_snapkv"]
    assert chunk.kvpress_label == "ChunkKVPress(SnapKVPress(window_size=64, kernel_size=5), chunk_length=16)"
    assert chunk.evalkit_label.startswith("snapkv_page --policy-arg window=64") and chunk.evalkit_label.endswith(
        "--block-size 16")
    # Rows without a wrapper keep their labels.
    assert presses["snapkv"].kvpress_label == "SnapKVPress(window_size=64, kernel_size=5)"
    assert presses["knorm"].kvpress_label == "KnormPress" and presses["knorm"].evalkit_label == "knorm_head"


def test_finished_run_is_the_cells_own_not_its_baseline(parity, tmp_path):
    # `evalkit run` without --no-baseline also stores the full-cache run in the cell's folder.
    import json
    import os

    cell = parity.cells(("keydiff",), (0.5,))[0]
    for name, policy, budget, mtime in (("own", "keydiff_head", 0.5, 1000), ("base", "full", 1.0, 2000)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"config": {"policy": policy, "budget": budget}}))
        (run / "metrics.json").write_text("{}")
        os.utime(run / "metrics.json", (mtime, mtime))
    assert parity.finished_run(tmp_path, cell).name == "own"
    assert parity.finished_run(tmp_path).name == "base"  # the newest, whatever made it
    assert parity.finished_run(tmp_path, parity.cells(("snapkv",), (0.5,))[0]) is None


def test_kvzip_and_duo_attention_rows(parity):
    presses = parity.PRESSES
    kvzip = presses["kvzip"]  # kvpress's defaults are kvzip_head's: no policy-arg, no wrapper
    assert kvzip.kvpress_label == "KVzipPress" and kvzip.policy == "kvzip_head" and not kvzip.policy_args
    assert not kvzip.eager and not kvzip.calibration and "kvzip" in parity.DEFAULT_PRESSES
    duo = presses["duo_attention"]  # not eager (DuoAttentionPress asserts it), calibrated on evalkit's text
    assert duo.matched and not duo.eager and duo.calibration and "duo_attention" in parity.DEFAULT_PRESSES
    half, fifth = parity.cells(("duo_attention",), (0.5, 0.2))
    # The removed fraction is kvpress's head_compression_ratio and evalkit's policy-arg of that name; the budget is
    # the keep fraction (below the prompt, so evalkit compresses).
    assert half.kvpress_label == "DuoAttentionPress(on_the_fly_scoring=True, head_compression_ratio=0.5)"
    assert fifth.policy_args == ("head_compression_ratio=0.8",) and fifth.budget == "0.2"
    assert fifth.evalkit_label == "duo_attention --policy-arg head_compression_ratio=0.8"
    # Other rows' cell labels are their press's.
    snap = parity.cells(("snapkv",), (0.2,))[0]
    assert snap.kvpress_label == presses["snapkv"].kvpress_label
    assert snap.evalkit_label == presses["snapkv"].evalkit_label


def test_the_helper_compiles_and_features_gate_the_ratio_arg(parity):
    compile(parity.KVPRESS_HELPER, "kvpress_helper.py", "exec")
    cell = parity.cells(("duo_attention",), (0.5,))[0]
    features = {"policy_arg": True, "policies": {"duo_attention"}, "policy_args": {"duo_attention": {"sink_size"}}}
    assert "has no policy-arg head_compression_ratio" in parity.missing_feature(cell, features)
    features["policy_args"]["duo_attention"].add("head_compression_ratio")
    assert parity.missing_feature(cell, features) is None


def test_finished_run_knows_an_alias_by_its_canonical_name(parity, tmp_path):
    # `evalkit run --policy tova` records the canonical name, tova_token: the tova cell must still find its run.
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"policy": "tova_token", "budget": 0.5}}))
    (run / "metrics.json").write_text("{}")
    assert parity.finished_run(tmp_path, parity.cells(("tova",), (0.5,))[0]).name == "run"
    assert parity.finished_run(tmp_path, parity.cells(("tova_head",), (0.5,))[0]) is None


def test_evalkit_rules_cache_kvpress_apart_and_reuse_the_evalkit_runs(parity, tmp_path):
    plain, ruled = (parity.cells(("lagkv",), (0.2,), rules)[0] for rules in parity.RULES)
    assert ruled.kvpress_key == "lagkv-keep0.2-evalkit-rules" and plain.kvpress_key == "lagkv-keep0.2"
    assert parity.evalkit_dir(tmp_path, "d", ruled) == parity.evalkit_dir(tmp_path, "d", plain)  # the same evalkit run
    assert ruled.kvpress_label.endswith("evalkit's count and ties")
    data = tmp_path / "niah.jsonl"
    assert parity.table_stem(data, "evalkit") == "parity-niah-evalkit-rules" and parity.table_stem(data, "kvpress") == \
        "parity-niah"
    args = parity.parse_args(["--kvpress-rules", "evalkit", "--presses", "lagkv,keydiff,snapkv,critical_snapkv"])
    assert args.kvpress_rules == "evalkit"


def test_the_helpers_evalkit_rules_keep_evalkits_count_and_the_earlier_of_tied_tokens(parity, tmp_path, monkeypatch):
    import json
    import types

    import torch

    class ScorerPress:  # kvpress's, as far as the helper reads it
        def compress(self, *args):
            raise AssertionError("kvpress's own compress")

    fakes = {"kvpress": types.ModuleType("kvpress"), "kvpress.presses": types.ModuleType("kvpress.presses"),
             "kvpress.presses.scorer_press": types.ModuleType("kvpress.presses.scorer_press")}
    fakes["kvpress.presses.scorer_press"].ScorerPress = ScorerPress
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "data.jsonl").write_text("")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"data": str(tmp_path / "data.jsonl"), "model": "", "cells": [], "tokens": None}))
    monkeypatch.setattr(sys, "argv", ["kvpress_helper.py", str(job)])
    helper: dict = {}
    exec(compile(parity.KVPRESS_HELPER, "kvpress_helper.py", "exec"), helper)  # no cells: defines, runs nothing

    n = 15  # keep 0.2: evalkit keeps ceil(3.0) = 3 (kvpress: int(15 * (1 - 0.8)) = 2)
    scores = torch.tensor([[[0.0, 5.0, 1.0, 5.0, 1.0, 1.0, 0.0, 1.0, 5.0, 1.0, 2.0, 2.0, 0.0, 2.0, 0.0]]])
    keys = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    press = types.SimpleNamespace(score=lambda *args: scores)
    module = types.SimpleNamespace(head_dim=1)
    kept_keys, kept_values = helper["evalkit_rules"](0.2)(press, module, None, keys, keys + 100, None, {})
    assert kept_keys.flatten().tolist() == [1.0, 3.0, 8.0]  # the three 5s, in position order
    scores[0, 0, 8] = 0.0  # now two 5s, then three tied 2s (positions 10, 11, 13): the earliest of them
    kept_keys, kept_values = helper["evalkit_rules"](0.2)(press, module, None, keys, keys + 100, None, {})
    assert kept_keys.flatten().tolist() == [1.0, 3.0, 10.0] and kept_values.flatten().tolist() == [101.0, 103.0, 110.0]


def test_the_table_keeps_earlier_invocations_complete_rows(parity, tmp_path):
    # A narrower invocation (one press, one keep) rewrites the table: rows complete on disk from earlier ones stay,
    # half-done or other-rules ones do not; rows come by keep, then in PRESSES' order.
    import json

    data = tmp_path / "data" / "d.jsonl"
    records = [{"id": "a"}, {"id": "b"}]

    def store(key, ids, press=None, keep=None):
        cache = parity.kvpress_cache(tmp_path, data.stem, key)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({i: {"answer": "x", "seconds": 1.0} for i in ids}))
        if press:  # and its finished evalkit run
            cell = parity.cells((press,), (keep,))[0]
            run = parity.evalkit_dir(tmp_path, data.stem, cell) / "run"
            run.mkdir(parents=True)
            (run / "config.json").write_text(json.dumps({"config": {"policy": cell.press.policy,
                                                                   "budget": float(cell.budget)}}))
            (run / "metrics.json").write_text("{}")

    store("snapkv-keep0.5", "ab", "snapkv", 0.5)
    store("lagkv-keep0.2", "ab", "lagkv", 0.2)
    store("lagkv-keep0.2-evalkit-rules", "ab")
    store("knorm-keep0.5", "a", "knorm", 0.5)  # kvpress stopped half-way
    store("tova-keep0.5", "ab")  # no evalkit run
    todo = parity.cells(("keydiff",), (0.2,))
    assert [c.key for c in parity.table_cells(tmp_path, data, records, todo, "kvpress")] == \
        ["snapkv-keep0.5", "keydiff-keep0.2", "lagkv-keep0.2"]
    ruled = parity.cells(("keydiff",), (0.2,), "evalkit")
    assert [(c.key, c.rules) for c in parity.table_cells(tmp_path, data, records, ruled, "evalkit")] == \
        [("keydiff-keep0.2", "evalkit"), ("lagkv-keep0.2", "evalkit")]
