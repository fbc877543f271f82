"""`evalkit bench --speed` on a tiny random model: every measurement's rows in speed.json, the shared sweep's
results identical to one run per cell, bad input refused. Structure only: nothing here depends on how
fast anything ran."""

import json
import math

import pytest

from conftest import needs_model_files
from helpers import run_cli

pytestmark = pytest.mark.model  # every test benches tiny_model_dir: the default model's tokenizer

LENGTH = 320  # the sweep's niah_single_2 prompts need room for a needle and the question


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_model_dir(tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def speed_run(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("speed")
    code, out, err = run_cli("bench", "--speed", "all", "--model", str(tiny_model_dir), "--lengths", str(LENGTH),
                             "--repeats", "1", "--samples", "1", "--out", str(out_dir))
    assert code == 0, err
    return json.loads((out_dir / "speed.json").read_text()), out


def test_every_measurement_has_its_rows_and_positive_ratios(speed_run, tiny_model_dir):
    document, _ = speed_run
    rows = document["rows"]
    by_measure = {}
    for row in rows:
        by_measure.setdefault(row["measure"], []).append(row)
    assert sorted(by_measure) == ["kvzip", "loop", "overhead", "ppl", "ppl loop", "ppl static", "statistics", "sweep",
                                  "sweep memory"]
    assert [r["length"] for r in by_measure["kvzip"]] == [LENGTH]
    assert [r["length"] for r in by_measure["loop"]] == [LENGTH]
    (loop,) = by_measure["loop"]
    for side in ("hf", "evalkit"):  # the whole generation splits into its prefill (1 new token) and the rest
        assert 0 < loop[f"{side}_prefill_seconds"]
        assert math.isclose(loop[f"{side}_prefill_seconds"] + loop[f"{side}_decode_seconds"], loop[f"{side}_seconds"])
    assert {r["case"] for r in by_measure["overhead"]} == {
        "full cache", "h2o_head @ 0.2, no decode eviction", "h2o_head @ 0.2, decode eviction"}
    steps = {r["case"]: r["evalkit_step_ops"] for r in by_measure["overhead"]}
    assert all(r["hf_step_ops"] > 0 for r in by_measure["overhead"])
    # Operator counts do not depend on the machine's load: evicting a token a step costs operators.
    assert steps["h2o_head @ 0.2, decode eviction"] > steps["h2o_head @ 0.2, no decode eviction"] > 0
    floor = "h2o floor: plain + the scores' matmul alone"
    assert {r["case"] for r in by_measure["statistics"]} == {"h2o column sums", "snapkv window 32", "both", floor}
    for row in rows:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        assert row["target"].startswith(("<=", ">=")) or row["case"] in ("both", floor) or \
            row["measure"] in ("ppl", "ppl static"), row
    (floor_row,) = [r for r in by_measure["statistics"] if r["case"] == floor]
    assert floor_row["ratio"] > 1 and floor_row["seconds"] > floor_row["plain_seconds"]
    assert document["command"].startswith("evalkit bench --speed all")
    assert document["model"] == str(tiny_model_dir)


def test_token_by_token_perplexity_is_timed_against_its_baselines_with_the_same_log_probabilities(speed_run):
    """`ppl`: one passage of LENGTH tokens, LENGTH - 1 of them fed one at a time; the static step's log-probabilities
    are the eager step's, and evalkit's at budget 1 HF's own token by token, to float32 rounding."""
    document, out = speed_run
    rows = {r["measure"]: r for r in document["rows"] if r["measure"].startswith("ppl")}
    assert all(r["length"] == LENGTH and r["tokens"] == LENGTH - 1 and r["seconds"] > 0 for r in rows.values())
    assert rows["ppl"]["one_forward_seconds"] > 0 and rows["ppl static"]["eager_seconds"] > 0
    assert rows["ppl static"]["max_logprob_difference"] < 1e-4
    assert rows["ppl loop"]["max_logprob_difference"] < 1e-4 and rows["ppl loop"]["hf_seconds"] > 0
    assert "tok/s" in out and "HF token by token" in out


def test_the_shared_sweep_writes_what_one_run_per_cell_writes(speed_run):
    document, out = speed_run
    (sweep,) = [r for r in document["rows"] if r["measure"] == "sweep"]
    assert sweep["cells"] == 25 and sweep["samples"] == 1
    assert sweep["identical_results"] is True
    (memory,) = [r for r in document["rows"] if r["measure"] == "sweep memory"]
    assert memory["sweep_peak_rss"] > 0 and memory["full_run_peak_rss"] > 0
    assert "RESULTS DIFFER" not in out and "speed.json" in out


def test_one_measurement_can_be_picked(tiny_model_dir, tmp_path):
    code, _, err = run_cli("bench", "--speed", "statistics", "--model", str(tiny_model_dir), "--lengths", "64,128",
                           "--repeats", "1", "--out", str(tmp_path / "speed"))
    assert code == 0, err
    rows = json.loads((tmp_path / "speed" / "speed.json").read_text())["rows"]
    assert {r["measure"] for r in rows} == {"statistics"}
    assert sorted({r["length"] for r in rows}) == [64, 128]


@pytest.mark.parametrize("args, message", [
    (["--speed", "loop,fast"], "unknown --speed measurement 'fast'"),
    (["--speed", "loop", "--repeats", "0"], "repeats must be >= 1"),
    (["--speed", "sweep", "--samples", "0"], "samples must be >= 1"),
    (["--speed", "loop", "--threads", "-2"], "threads must be >= 0"),
    (["--speed", "loop", "--lengths", "1m"], "length must be a positive integer"),
    (["--speed", "loop", "--lengths", "100000"], "exceeds the"),
])
def test_bad_speed_input_is_one_line_and_exit_2_with_nothing_written(tiny_model_dir, tmp_path, args, message):
    out_dir = tmp_path / "speed"
    code, _, err = run_cli("bench", "--model", str(tiny_model_dir), *args, "--out", str(out_dir))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out_dir.exists()
