"""scripts/granularity_tables.py on tiny run folders written here, as `evalkit sweep` writes them (no model)."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "granularity_tables.py"
GRANULARITIES = ("head", "head_page", "token", "page")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("granularity_tables", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["granularity_tables"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def write_run(root: Path, task: str, policy: str, budget: float, scores: list[float], *, length: int = 2048,
              model: str = "smollm2-135m", query_aware: bool = True, finished: bool = True) -> Path:
    """A run folder as the runner leaves it: config.json, one prediction line a finished sample, and
    metrics.json once the run is complete."""
    mode = "qa" if query_aware else "qg"
    run = root / f"{task.removeprefix('ruler:')}-{policy}-{budget}-{model}-{length}-{mode}"
    run.mkdir(parents=True)
    config = {"task": task, "length": length, "model": model, "policy": policy, "budget": budget,
              "block_size": 16, "query_aware": query_aware, "samples": len(scores), "sliding_layers": "budget"}
    (run / "config.json").write_text(json.dumps({"config": config, "run_id": run.name}))
    full_bytes = 1000 * length
    records = [{"id": f"{task}-{i:04d}", "score": score, "bytes_full": full_bytes, "bytes_held": budget * full_bytes,
                "bytes_ideal": budget * full_bytes, "prefill_seconds": 1.0, "prediction": "", "references": []}
               for i, score in enumerate(scores)]
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        metrics = {"samples": len(scores), "n": len(scores), "score": sum(scores) / len(scores),
                   "held_over_full": budget, "held_over_ideal": 1.0}
        (run / "metrics.json").write_text(json.dumps(metrics))
    return run


def write_setting(root: Path, task: str, full: list[float], by_granularity: dict[str, list[float]],
                  scorer: str = "snapkv", budgets=(0.1,), **setting) -> None:
    write_run(root, task, "full", 1.0, full, **setting)
    for budget in budgets:
        for granularity, scores in by_granularity.items():
            write_run(root, task, f"{scorer}_{granularity}", budget, scores, **setting)


def same_everywhere(scores: list[float]) -> dict[str, list[float]]:
    return {g: scores for g in GRANULARITIES}


def summary_rows(text: str) -> list[list[str]]:
    """The summary's body rows, split into cells."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| family")]


def test_settings_of_other_lengths_and_models_stay_apart(script, tmp_path):
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 5 + [0] * 5))
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 8 + [0] * 2, same_everywhere([0] * 10), length=4096)
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 6 + [0] * 4, same_everywhere([1] * 10), model="gemma3-270m")
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 7 + [0] * 3, same_everywhere([1] * 10), query_aware=False)
    groups = script.group(script.load([str(tmp_path)]))

    assert [str(g.setting) for g in groups] == [
        "ruler:niah_single_1, 2,048 tokens, gemma3-270m, query-aware",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware",
        "ruler:niah_single_1, 4,096 tokens, smollm2-135m, query-aware",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-agnostic"]  # query-aware first, as before
    headings = [line for line in script.tables(groups).splitlines() if line.startswith("**")]
    assert [h.rsplit("full cache: ", 1)[1] for h in headings] == ["60)", "100)", "80)", "70)"]
    cells = {(row[2], row[3], row[4]): row[8] for row in summary_rows(script.summary(groups))}  # head's score
    assert cells == {("2,048", "gemma3-270m", "query-aware"): "100", ("2,048", "smollm2-135m", "query-aware"): "50",
                     ("4,096", "smollm2-135m", "query-aware"): "0", ("2,048", "smollm2-135m", "query-agnostic"): "100"}


def test_the_full_cache_below_the_floor_is_marked_there_only(script, tmp_path):
    write_setting(tmp_path, "ruler:cwe", [0.1] * 10, same_everywhere([0.0] * 10))  # 10: the model cannot
    write_setting(tmp_path, "ruler:vt", [1] * 5 + [0] * 5, same_everywhere([0] * 10))  # 50: at the floor, not below
    groups = script.group(script.load([str(tmp_path)]))
    text = "\n".join([script.summary(groups), script.tables(groups), script.paired_tables(groups)])

    marked = [line for line in text.splitlines() if script.FULL_CACHE_WARNING in line]
    assert len(marked) == 2 and all(line.startswith("**ruler:cwe, ") for line in marked)  # score and paired tables
    assert "full cache: 10 — ⚠" in marked[0]
    assert {row[1]: row[7] for row in summary_rows(script.summary(groups))} == {"ruler:cwe": "10 ⚠", "ruler:vt": "50"}


@pytest.mark.parametrize("head_page, head, verdict", [
    ([1] * 20, [0] * 20, "per-head pages win"),  # 20 discordant pairs, all one way: exact p = 2 / 2**20
    ([0] * 20, [1] * 20, "per-head pages lose"),
    ([1] * 3 + [0] * 17, [0] * 20, "tie"),  # 3 discordant pairs: p = 0.25
])
def test_a_win_or_a_loss_needs_a_significant_difference(script, tmp_path, head_page, head, verdict):
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 20,
                  {"head": head, "head_page": head_page, "token": head, "page": head_page})
    groups = script.group(script.load([str(tmp_path)]))
    (row,) = summary_rows(script.summary(groups))

    test = groups[0].paired["snapkv", 0.1]["head_page", "head"]
    assert row[-1] == verdict and row[12] == str(test)
    assert (test.p_value < 0.05) == (verdict != "tie")
    if verdict != "tie":  # Holm multiplies the smallest of the ten p-values by at most 10
        assert 2 / 2 ** 20 <= test.p_value <= 10 * 2 / 2 ** 20 and row[12].startswith("**")


def test_the_summary_shows_the_paired_tables_numbers(script, tmp_path):
    pattern = [[1, 0, 1, 1, 0, 1, 1, 1, 0, 1] * 3, [0, 0, 1, 0, 0, 1, 0, 0, 0, 1] * 3,
               [0, 1, 1, 0, 0, 1, 0, 1, 0, 0] * 3, [1, 1, 1, 1, 0, 1, 0, 1, 1, 1] * 3]
    write_run(tmp_path, "ruler:niah_multikey_1", "full", 1.0, [1] * 30)
    for shift, budget in enumerate((0.1, 0.3)):
        for i, granularity in enumerate(GRANULARITIES):
            write_run(tmp_path, "ruler:niah_multikey_1", f"h2o_{granularity}", budget, pattern[(i + shift) % 4])
    write_setting(tmp_path, "ruler:fwe", [0.9] * 30, {g: [(i + k) % 3 / 2 for k in range(30)]
                                                     for i, g in enumerate(GRANULARITIES)})  # fractions: bootstrap
    groups = script.group(script.load([str(tmp_path)]))
    paired = script.paired_tables(groups)

    columns = [f"{a} − {b}" for a, b in script.COMPARISONS]
    rows = summary_rows(script.summary(groups))
    assert len(rows) == 3
    for row in rows:
        heading = f"**{row[1]}, {row[2]} tokens, {row[3]}, {row[4]}: paired tests**"
        table = paired.split(heading, 1)[1].split("\n\n", 2)[1]
        line = next(line for line in table.splitlines() if line.startswith(f"| {row[5]} @ {row[6]} |"))
        shown = dict(zip(columns, [cell.strip() for cell in line.strip("|").split("|")][1:]))
        assert row[12:15] == [shown["head_page − head"], shown["head_page − page"], shown["head_page − token"]]
        assert all(re.fullmatch(r"\**[+-]\d+ \(p = [0-9.e+-]+\)\**", cell) for cell in row[12:15])


def test_a_run_still_going_counts_its_finished_samples_and_one_with_none_is_left_out(script, tmp_path):
    write_setting(tmp_path, "ruler:qa_1", [1] * 10, same_everywhere([1] * 10))
    write_run(tmp_path, "ruler:qa_1", "snapkv_head", 0.3, [1, 1, 0, 0], finished=False)
    started = write_run(tmp_path, "ruler:qa_1", "snapkv_head_page", 0.3, [1], finished=False)
    (started / "predictions.jsonl").write_text('{"id": "ruler:qa_1-0000", "sco')  # its first line half-written
    groups = script.group(script.load([str(tmp_path)]))

    (here,) = groups
    assert here.cell("snapkv", "head", 0.3)["metrics"]["score"] == 0.5
    assert here.cell("snapkv", "head_page", 0.3) is None
    tests = here.paired["snapkv", 0.3]
    assert tests["head", "full"].difference == -0.5  # on the four samples both finished
    assert tests["head_page", "head"] is None


def test_plots_are_written_for_each_family_present(script, tmp_path):
    runs = tmp_path / "runs"
    for task in ("ruler:niah_single_1", "ruler:niah_single_3", "ruler:qa_2", "ruler:vt", "niah_grid"):
        write_setting(runs, task, [1] * 10, same_everywhere([1] * 5 + [0] * 5), budgets=(0.1, 0.5))
    write_setting(runs, "ruler:cwe", [0.2] * 10, same_everywhere([0.1] * 10), budgets=(0.1, 0.5))  # left out
    write_setting(runs, "ruler:vt", [1] * 10, same_everywhere([1] * 10), budgets=(0.1,), length=4096,
                  query_aware=False)
    paths = script.plot_families(script.group(script.load([str(runs)])), tmp_path / "plots")

    assert [p.name for p in paths] == [
        "granularity-single-needle-smollm2-135m-2048-query-aware.png",
        "granularity-tracing-smollm2-135m-2048-query-aware.png",
        "granularity-tracing-smollm2-135m-4096-query-agnostic.png",
        "granularity-aggregation-smollm2-135m-2048-query-aware.png",
        "granularity-qa-smollm2-135m-2048-query-aware.png",
        "granularity-other-smollm2-135m-2048-query-aware.png"]
    assert all(p.parent == tmp_path / "plots" and p.stat().st_size > 0 for p in paths)
