"""scripts/granularity_tables.py on tiny run folders written here, as `evalkit sweep` writes them (no model)."""

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import matplotlib.image
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
              model: str = "smollm2-135m", query_aware: bool = True, finished: bool = True, omit: tuple = (),
              created: str = "2026-12-03T00:00:00+0000", prefill_seconds: float = 1.0, answers: tuple = (),
              value: str | None = None, **fields) -> Path:
    """A run folder as the runner leaves it: config.json (any other RunConfig `fields`; `omit`: fields an
    older evalkit did not write), one prediction line a finished sample (its answer from `answers`, its
    reference `value`, where given), and metrics.json once the run is complete. The folder is named after the
    config's digest, as the runner names it."""
    config = {"task": task, "length": length, "model": model, "policy": policy, "budget": budget,
              "block_size": 16, "query_aware": query_aware, "samples": len(scores), "sliding_layers": "budget",
              "granularity": None, **fields}
    config = {k: v for k, v in config.items() if k not in omit}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    run = root / f"{task.removeprefix('ruler:')}-{policy}-{budget}-{digest}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": config, "run_id": run.name, "created": created}))
    full_bytes = 1000 * length
    records = [{"id": f"{task}-{i:04d}", "score": score, "bytes_full": full_bytes, "bytes_held": budget * full_bytes,
                "bytes_ideal": budget * full_bytes, "prefill_seconds": prefill_seconds,
                "prediction": answers[i] if answers else "", "references": [value] if value else []}
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

    assert [g.name for g in groups] == [
        "ruler:niah_single_1, 2,048 tokens, gemma3-270m, query-aware",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware",
        "ruler:niah_single_1, 4,096 tokens, smollm2-135m, query-aware",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-agnostic"]  # query-aware first, as before
    headings = [line for line in script.tables(groups).splitlines() if line.startswith("**")]
    assert [h.rsplit("full cache: ", 1)[1] for h in headings] == ["60)", "100)", "80)", "70)"]
    cells = {(row[2], row[3], row[4]): row[8] for row in summary_rows(script.summary(groups))}  # head's score
    assert cells == {("2,048", "gemma3-270m", "query-aware"): "100", ("2,048", "smollm2-135m", "query-aware"): "50",
                     ("4,096", "smollm2-135m", "query-aware"): "0", ("2,048", "smollm2-135m", "query-agnostic"): "100"}


def test_runs_of_other_seeds_or_sample_counts_stay_apart_and_the_headings_say_how(script, tmp_path):
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 10))
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 5 + [0] * 5, same_everywhere([0] * 10), seed=1)
    write_setting(tmp_path, "ruler:niah_single_1", [0] * 20, same_everywhere([1] * 20))
    groups = script.group(script.load([str(tmp_path)]))

    assert [g.name for g in groups] == [
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware (samples=10, seed=0)",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware (samples=10, seed=1)",
        "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware (samples=20, seed=0)"]
    # each paired with its own full cache, on its own samples
    assert [g.paired["snapkv", 0.1]["head", "full"].difference for g in groups] == [0.0, -0.5, 1.0]
    rows = summary_rows(script.summary(groups))
    assert [(row[4], row[8]) for row in rows] == [("query-aware (samples=10, seed=0)", "100"),
                                                  ("query-aware (samples=10, seed=1)", "0"),
                                                  ("query-aware (samples=20, seed=0)", "100")]


def test_a_field_an_older_run_did_not_write_is_its_default(script, tmp_path):
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10, omit=("sliding_layers", "granularity"))
    for granularity in GRANULARITIES:
        write_run(tmp_path, "ruler:niah_single_1", f"snapkv_{granularity}", 0.1, [1] * 10)
    (here,) = script.group(script.load([str(tmp_path)]))

    assert here.full is not None and here.name == "ruler:niah_single_1, 2,048 tokens, smollm2-135m, query-aware"


def test_policy_arguments_make_a_setting_compared_with_the_full_cache_without_them(script, tmp_path):
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 10))
    for granularity in GRANULARITIES:  # the same policies and budget, another observation window
        write_run(tmp_path, "ruler:niah_single_1", f"snapkv_{granularity}", 0.1, [0] * 10,
                  policy_args={"window": "8"})
    groups = script.group(script.load([str(tmp_path)]))

    assert [g.differs for g in groups] == ['policy_args={"window": "8"}', "policy_args={}"]
    assert groups[0].full is groups[1].full is not None  # `RunConfig.full_cache`: no policy arguments
    assert [g.cell("snapkv", "head", 0.1)["metrics"]["score"] for g in groups] == [0.0, 1.0]


@pytest.mark.parametrize("second", [
    {"policy": "snapkv_head"},  # the same run in a second folder, with other answers
    {"policy": "snapkv", "granularity": "head"},  # `snapkv` is `snapkv_head`
    {"policy": "full", "budget": 1.0},
])
def test_two_runs_of_one_setting_policy_and_budget_are_an_error(script, tmp_path, second):
    write_setting(tmp_path / "a", "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 10))
    fields = {"policy": "snapkv_head", "budget": 0.1, **second}
    write_run(tmp_path / "b", "ruler:niah_single_1", fields.pop("policy"), fields.pop("budget"), [0] * 10, **fields)

    with pytest.raises(script.EvalkitError) as error:
        script.group(script.load([str(tmp_path / "a"), str(tmp_path / "b")]))
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "a") in message and str(tmp_path / "b") in message


def test_aliases_and_granularity_runs_count_as_the_granularity_they_ran(script, tmp_path):
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10)
    for policy, scores in (("h2o", [0] * 10), ("h2o_head_page", [1] * 10), ("h2o_block1", [1] * 5 + [0] * 5),
                           ("h2o_page", [1] * 10)):  # h2o is h2o_head, h2o_block1 is h2o_token
        write_run(tmp_path, "ruler:niah_single_1", policy, 0.1, scores)
    for granularity in GRANULARITIES:  # `--policy random --granularity ...`
        write_run(tmp_path, "ruler:niah_single_1", "random", 0.1, [1] * 10, granularity=granularity)
    groups = script.group(script.load([str(tmp_path)]))

    rows = summary_rows(script.summary(groups))
    assert [(row[5], row[8:12]) for row in rows] == [("`h2o`", ["0", "100", "50", "100"]),
                                                     ("`random`", ["100", "100", "100", "100"])]
    policies = [line.split("`")[1] for line in script.tables(groups).splitlines() if line.startswith("| `")]
    assert policies == ["h2o_head", "h2o_head_page", "h2o_token", "h2o_page",
                        "random", "random@head_page", "random@token", "random@page"]


def test_the_full_cache_below_the_floor_is_marked_there_only(script, tmp_path):
    write_setting(tmp_path, "ruler:cwe", [0.1] * 10, same_everywhere([0.0] * 10))  # 10: the model cannot
    write_setting(tmp_path, "ruler:vt", [1] * 4 + [0] * 6, same_everywhere([0] * 10))  # 40: above a third, not marked
    groups = script.group(script.load([str(tmp_path)]))
    text = "\n".join([script.summary(groups), script.tables(groups), script.paired_tables(groups)])

    marked = [line for line in text.splitlines() if script.FULL_CACHE_WARNING in line]
    assert len(marked) == 2 and all(line.startswith("**ruler:cwe, ") for line in marked)  # score and paired tables
    assert "full cache: 10 — ⚠" in marked[0]
    assert {row[1]: row[7] for row in summary_rows(script.summary(groups))} == {"ruler:cwe": "10 ⚠", "ruler:vt": "40"}


@pytest.mark.parametrize("head_page, head, verdict", [
    ([1] * 20, [0] * 20, "per-head pages win"),  # 20 discordant pairs, all one way: exact p = 2 / 2**20
    ([0] * 20, [1] * 20, "per-head pages lose"),
    ([1] * 3 + [0] * 17, [0] * 20, "no difference detected (n = 20; "),  # 3 discordant pairs: p = 0.25
])
def test_a_win_or_a_loss_needs_a_significant_difference(script, tmp_path, head_page, head, verdict):
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 20,
                  {"head": head, "head_page": head_page, "token": head, "page": head_page})
    groups = script.group(script.load([str(tmp_path)]))
    (row,) = summary_rows(script.summary(groups))

    test = groups[0].paired["snapkv", 0.1]["head_page", "head"]
    assert row[-1].startswith(verdict) and row[12] == str(test)
    assert row[-1].endswith(f"p = {test.p_value:.2g} across rows)")  # one row: the across-rows p is its own
    assert (test.p_value < 0.05) == verdict.startswith("per-head")
    if verdict.startswith("per-head"):  # Holm multiplies the smallest of the ten p-values by at most 10
        assert 2 / 2 ** 20 <= test.p_value <= 10 * 2 / 2 ** 20 and row[12].startswith("**")


def test_a_comparison_that_cannot_be_made_counts_as_p_1_in_the_holm_family(script, tmp_path):
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head_page", 0.1, [1] * 5 + [0] * 15)
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head", 0.1, [0] * 20)  # no full cache, no token or page
    (here,) = script.group(script.load([str(tmp_path)]))

    tests = here.paired["snapkv", 0.1]
    assert [pair for pair, test in tests.items() if test] == [("head_page", "head")]
    assert tests["head_page", "head"].p_value == pytest.approx(10 * 2 / 2 ** 5)  # 5 discordant pairs, one way


def test_the_verdict_is_holm_adjusted_across_the_summary_rows(script, tmp_path):
    def write(task):  # 9 discordant pairs, one way: exact p = 2 / 2**9, times 10 within the cell = 0.039
        write_run(tmp_path, task, "snapkv_head_page", 0.1, [1] * 9 + [0] * 11)
        write_run(tmp_path, task, "snapkv_head", 0.1, [0] * 20)

    write("ruler:niah_single_1")
    (row,) = summary_rows(script.summary(script.group(script.load([str(tmp_path)]))))
    assert row[12] == "**+45 (p = 0.039, n = 20)**" and row[-1] == "per-head pages win (p = 0.039 across rows)"

    write("ruler:niah_single_3")  # two rows: each p times 2
    rows = summary_rows(script.summary(script.group(script.load([str(tmp_path)]))))
    assert [(row[12], row[-1]) for row in rows] == [
        ("**+45 (p = 0.039, n = 20)**", "no difference detected (n = 20; p = 0.078 across rows)")] * 2


def test_a_scorer_without_a_run_at_a_budget_has_no_row_there(script, tmp_path):
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 10), budgets=(0.1, 0.3))
    for granularity in GRANULARITIES:
        write_run(tmp_path, "ruler:niah_single_1", f"h2o_{granularity}", 0.1, [1] * 10)
    groups = script.group(script.load([str(tmp_path)]))

    assert [(row[5], row[6]) for row in summary_rows(script.summary(groups))] == [
        ("`h2o`", "0.1"), ("`snapkv`", "0.1"), ("`snapkv`", "0.3")]
    assert [line.split(" |")[0] for line in script.paired_tables(groups).splitlines() if line.startswith("| `")] == [
        "| `h2o` @ 0.1", "| `snapkv` @ 0.1", "| `snapkv` @ 0.3"]


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
        assert all(re.fullmatch(r"\**[+-]\d+ \(p = [0-9.e+-]+, n = 30\)\**", cell) for cell in row[12:15])


def test_a_run_still_going_counts_its_finished_samples_and_one_with_none_is_left_out(script, tmp_path):
    write_setting(tmp_path, "ruler:qa_1", [1] * 10, same_everywhere([1] * 10))
    write_run(tmp_path, "ruler:qa_1", "snapkv_head", 0.3, [1, 1, 0, 0], finished=False, samples=10)
    started = write_run(tmp_path, "ruler:qa_1", "snapkv_head_page", 0.3, [1], finished=False, samples=10)
    (started / "predictions.jsonl").write_text('{"id": "ruler:qa_1-0000", "sco')  # its first line half-written
    groups = script.group(script.load([str(tmp_path)]))

    (here,) = groups
    assert here.cell("snapkv", "head", 0.3)["metrics"]["score"] == 0.5
    assert here.cell("snapkv", "head_page", 0.3) is None
    tests = here.paired["snapkv", 0.3]
    assert tests["head", "full"].difference == -0.5 and tests["head", "full"].samples == 4  # the four both finished
    assert tests["head_page", "head"] is None
    row = next(row for row in summary_rows(script.summary(groups)) if row[6] == "0.3")
    assert row[8] == "50" and row[-1] == "–"  # its score on the four it finished


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


def test_a_task_the_full_cache_cannot_do_is_left_out_of_its_familys_lines(script, tmp_path):
    write_setting(tmp_path, "ruler:niah_single_1", [1] * 10, same_everywhere([1] * 5 + [0] * 5), budgets=(0.1, 0.5))
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 10, same_everywhere([1] * 10), budgets=(0.1,))
    write_setting(tmp_path, "ruler:niah_single_3", [1] * 3 + [0] * 7, same_everywhere([0] * 10), budgets=(0.1, 0.5))
    (plot,) = script.family_plots(script.group(script.load([str(tmp_path)])))

    assert plot.tasks == ["ruler:niah_single_1", "ruler:niah_single_2"]
    assert plot.left_out == ["ruler:niah_single_3"]
    # 0.1 averages single_1 (50) and single_2 (100); 0.5, which single_2 lacks, is not drawn
    assert {g: {b: score for b, (score, _) in points.items()} for g, points in plot.panels["snapkv"].lines.items()} == \
        {g: {0.1: 75.0} for g in GRANULARITIES}
    assert plot.panels["snapkv"].full_score == 100.0


def test_a_family_whose_every_task_is_below_the_floor_is_drawn_whole_and_marked(script, tmp_path):
    """Where the model can do none of a family's tasks the plot would be empty: it draws them all, marked."""
    write_setting(tmp_path, "ruler:niah_multivalue", [0.3] * 10, same_everywhere([0.2] * 10), budgets=(0.2, 0.5))
    write_setting(tmp_path, "ruler:niah_multiquery", [0.2] * 10, same_everywhere([0.1] * 10), budgets=(0.2, 0.5))
    (plot,) = script.family_plots(script.group(script.load([str(tmp_path)])))

    assert plot.below_floor and plot.left_out == []
    assert sorted(plot.tasks) == ["ruler:niah_multiquery", "ruler:niah_multivalue"]
    assert {b: score for b, (score, _) in plot.panels["snapkv"].lines["head_page"].items()} == \
        pytest.approx({0.2: 15.0, 0.5: 15.0})  # the mean over both tasks' samples
    assert plot.panels["snapkv"].full_score == pytest.approx(25.0)
    (path,) = script.plot_families(script.group(script.load([str(tmp_path)])), tmp_path / "plots")
    assert path.stat().st_size > 0


def test_a_scorers_panel_averages_only_the_tasks_that_ran_it(script, tmp_path):
    """One task of the family ran a second scorer: that scorer's panel averages it alone (its full cache too)
    and names it, rather than drawing nothing for want of the other task's cells."""
    write_setting(tmp_path, "ruler:fwe", [0.6] * 10, same_everywhere([0.3] * 10), budgets=(0.2,))
    for granularity in GRANULARITIES:
        write_run(tmp_path, "ruler:fwe", f"tova_{granularity}", 0.2, [0.1] * 10)
    write_setting(tmp_path, "ruler:cwe", [0.4] * 10, same_everywhere([0.1] * 10), budgets=(0.2,))
    (plot,) = script.family_plots(script.group(script.load([str(tmp_path)])))

    assert sorted(plot.panels) == ["snapkv", "tova"]
    assert sorted(plot.panels["snapkv"].tasks) == ["ruler:cwe", "ruler:fwe"]
    assert plot.panels["snapkv"].lines["head"][0.2][0] == pytest.approx(20.0)
    assert plot.panels["snapkv"].full_score == pytest.approx(50.0)
    assert plot.panels["tova"].tasks == ["ruler:fwe"]
    assert {g: points[0.2][0] for g, points in plot.panels["tova"].lines.items()} == \
        pytest.approx({g: 10.0 for g in GRANULARITIES})
    assert plot.panels["tova"].full_score == pytest.approx(60.0)
    (path,) = script.plot_families(script.group(script.load([str(tmp_path)])), tmp_path / "plots")
    assert path.stat().st_size > 0


def test_every_full_cache_run_is_listed_with_its_interval_and_marked_below_the_floor(script, tmp_path):
    """Full-cache runs with no policy cells (a baseline sweep before the grid) still get their row; a task the
    model cannot do is marked, one it can is not."""
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 20, length=4096)
    write_run(tmp_path, "ruler:cwe", "full", 1.0, [1] * 2 + [0] * 18, length=4096)
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 10, same_everywhere([1] * 10))
    rows = {row[1]: row for row in summary_rows(script.full_cache_table(script.load([str(tmp_path)])))
            if row[0] != "---"}
    assert set(rows) == {"ruler:niah_single_1", "ruler:cwe", "ruler:niah_single_2"}
    assert rows["ruler:niah_single_1"][5] == "100 (84–100)" and rows["ruler:niah_single_1"][6] == "20"
    assert rows["ruler:cwe"][5].startswith("10 (") and rows["ruler:cwe"][5].endswith("⚠")
    assert rows["ruler:cwe"][0] == "aggregation" and rows["ruler:niah_single_1"][2] == "4,096"
    assert script.full_cache_table([]) == ""


def test_a_run_just_begun_with_one_fractional_score_is_shown_without_an_interval(script, tmp_path, capsys):
    """One fractional sample has no bootstrap interval: the tables show the score and n, not a crash."""
    write_run(tmp_path, "ruler:fwe", "full", 1.0, [2 / 3] * 4)
    write_run(tmp_path, "ruler:fwe", "snapkv_head", 0.2, [1 / 3], finished=False, samples=4)
    runs = script.load([str(tmp_path)])
    table = script.tables(script.group(runs))
    assert "| `snapkv_head` | 33 (n = 1) |" in table, table


def test_compression_time_is_shown_only_against_a_full_cache_that_shared_the_prefill(script, tmp_path):
    """A cell's compression is its prefill minus the full cache's (the median over samples: a pause timed into
    one sample does not move it) only where one sweep made both (their folders within a minute): a full cache
    from a baseline sweep timed its own forward, so no difference is shown."""
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 4, prefill_seconds=3.0)
    paused = write_run(tmp_path, "ruler:niah_single_1", "h2o_head", 0.2, [1] * 4, prefill_seconds=3.5,
                       created="2026-12-03T00:00:02+0000")
    records = [json.loads(line) for line in (paused / "predictions.jsonl").read_text().splitlines()]
    records[0]["prefill_seconds"] = 1000.0  # the sweep was stopped for a quarter of an hour in this sample
    (paused / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run(tmp_path, "ruler:fwe", "full", 1.0, [1] * 4, prefill_seconds=30.0)
    write_run(tmp_path, "ruler:fwe", "h2o_head", 0.2, [1] * 4, prefill_seconds=3.5,
              created="2026-12-03T01:00:00+0000")
    tables = script.tables(script.group(script.load([str(tmp_path)]))).split("**ruler:")
    by_task = {chunk.split(",")[0]: chunk for chunk in tables[1:]}
    assert "| 0.50 |" in by_task["niah_single_1"], by_task["niah_single_1"]
    assert "| – |" in by_task["fwe"] and "-26.50" not in by_task["fwe"], by_task["fwe"]


@pytest.mark.parametrize("prediction, kind", [(" 26.", "first digits"), (" 265.99", "first digits"),
                                              (" 6088743.", "value-length number"), (" 1.", "other number"),
                                              (" 26569731", "other number"), (" The number is", "no number")])
def test_a_failed_answer_is_named_by_its_first_number(script, prediction, kind):
    assert script.failure_kind(prediction, "2656973") == kind


def test_failures_are_counted_on_the_samples_the_full_cache_answers(script, tmp_path):
    value = "2656973"
    write_run(tmp_path, "ruler:niah_single_2", "full", 1.0, [1, 1, 1, 0], value=value,
              answers=(value, value, value, " 1."))
    write_run(tmp_path, "ruler:niah_single_2", "snapkv_head", 0.2, [0, 0, 1, 0], value=value,
              answers=(" 26.", " 5551234.", value, " 9."))  # the last: the full cache failed it too
    write_run(tmp_path, "ruler:niah_single_2", "snapkv_head_page", 0.2, [1, 0, 1, 1], value=value,
              answers=(value, " none", value, value))
    write_run(tmp_path, "ruler:fwe", "full", 1.0, [1.0], value=None)  # not a one-number answer: no table
    write_run(tmp_path, "ruler:fwe", "snapkv_head", 0.2, [0.5])
    text = script.failures_table(script.group(script.load([str(tmp_path)])))
    assert "3 of 4" in text and "ruler:fwe" not in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| `")}
    assert rows["`snapkv_head` @ 0.2"] == ["3", "2", "1", "1", "0", "0"]
    assert rows["`snapkv_head_page` @ 0.2"] == ["3", "1", "0", "0", "0", "1"]


def auc_rows(text: str) -> dict[str, list[str]]:
    """The AUC table's rows by their scorer label: the cells after it."""
    return {cells[0]: cells[1:] for cells in summary_rows(text) if cells[0] != "scorer"}


def test_the_auc_table_averages_each_granularitys_score_over_budgets_and_tasks(script, tmp_path):
    # Scores per budget 0.1 / 0.2 / 0.5 (10 samples each): the trapezoid over the span 0.4 by hand.
    curves = {"head": (0.1, 0.2, 0.6), "head_page": (0.5, 0.8, 1.0), "token": (0.0, 0.1, 0.3), "page": (0.2, 0.4, 1.0)}
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10)
    for granularity, scores in curves.items():
        for budget, score in zip((0.1, 0.2, 0.5), scores):
            write_run(tmp_path, "ruler:niah_single_1", f"snapkv_{granularity}", budget,
                      [1] * round(10 * score) + [0] * (10 - round(10 * score)))
    # A second task: per-head tokens alone ran there, so it counts for no row (its granularities are not all there).
    write_run(tmp_path, "ruler:niah_single_2", "full", 1.0, [1] * 10)
    write_run(tmp_path, "ruler:niah_single_2", "snapkv_head", 0.1, [1] * 10)
    write_run(tmp_path, "ruler:niah_single_2", "snapkv_head", 0.2, [1] * 10)
    rows = auc_rows(script.auc_table(script.group(script.load([str(tmp_path)]))))

    expected = {g: 100 * (0.1 * (s[0] + s[1]) / 2 + 0.3 * (s[1] + s[2]) / 2) / 0.4 for g, s in curves.items()}
    assert expected == pytest.approx({"head": 33.75, "head_page": 83.75, "token": 16.25, "page": 60.0})
    assert rows["`snapkv`"] == ["34", "**84**", "16", "60", "100", "0.1 / 0.2 / 0.5", "niah_single_1"]


def test_the_auc_table_compares_a_rows_granularities_on_shared_samples_and_budgets(script, tmp_path):
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10)
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [0] * 10, length=4096)  # below the floor: left out
    for budget in (0.1, 0.5):
        write_run(tmp_path, "ruler:niah_single_1", "h2o_head", budget, [1] * 10, length=4096)
        write_run(tmp_path, "ruler:niah_single_1", "h2o_head", budget, [1] * 5 + [0] * 5)
        # still going: 6 samples finished, so its row compares every granularity on those 6 (5 pass at head)
        write_run(tmp_path, "ruler:niah_single_1", "h2o_head_page", budget, [0] * 6, finished=False, samples=10)
    write_run(tmp_path, "ruler:niah_single_1", "h2o_head", 0.2, [1] * 10)  # per-head tokens only: not a row budget
    write_run(tmp_path, "ruler:niah_single_1", "kvzip_head", 0.1, [1] * 10, policy_args={"layerwise": "true"})
    write_run(tmp_path, "ruler:niah_single_1", "kvzip_head", 0.5, [1] * 10, policy_args={"layerwise": "true"})
    text = script.auc_table(script.group(script.load([str(tmp_path)])))

    assert [line for line in text.splitlines() if line.startswith("**")] == [
        "**smollm2-135m, 2,048 tokens, query-aware (samples=10, seed=0; running: 6 to 10 samples finished)**: mean "
        "score over budgets (AUC / span, points)"]  # its runs' samples=10 is what they will hold, not what they do
    rows = auc_rows(text)
    assert rows["`h2o`"] == ["**83**", "0", "–", "–", "100", "0.1 / 0.5", "niah_single_1"]
    assert list(rows) == ["`kvzip` layerwise=true", "`h2o`"]  # best first


def test_a_run_in_two_folders_is_tabled_once_from_the_copy_with_more_samples(script, tmp_path):
    for folder, scores in (("a", [1] * 4), ("b", [1] * 4 + [0] * 6), ("c", [1] * 3)):
        write_run(tmp_path / folder, "ruler:niah_single_1", "full", 1.0, scores, samples=10)
    (run,) = script.load([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")])
    assert len(run["records"]) == 10 and run["folder"].parent.name == "b"


def test_the_command_line_tables_only_the_tasks_named(script, tmp_path, monkeypatch, capsys):
    for task in ("ruler:niah_single_1", "ruler:niah_single_2"):
        write_setting(tmp_path, task, [1] * 10, same_everywhere([1] * 5 + [0] * 5), budgets=(0.1, 0.5))
    monkeypatch.setattr(sys, "argv", ["granularity_tables.py", str(tmp_path), "--auc", "--task", "ruler:niah_single_2"])
    script.main()
    assert [row[-1] for row in auc_rows(capsys.readouterr().out).values()] == ["niah_single_2"]


def test_a_policy_argument_variant_is_set_against_its_scorer_at_each_granularity(script, tmp_path):
    write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10)
    write_run(tmp_path, "ruler:niah_single_1", "kvzip_head", 0.1, [1] * 10)
    write_run(tmp_path, "ruler:niah_single_1", "kvzip_head_page", 0.1, [0] * 10)
    write_run(tmp_path, "ruler:niah_single_1", "kvzip_head", 0.1, [0] * 10, policy_args={"layerwise": "true"})
    rows = summary_rows(script.variant_table(script.group(script.load([str(tmp_path)]))))

    # 10 samples only one run passes: exact McNemar 2 x 0.5^10, Holm over the variant's two tests
    assert [row[1:] for row in rows if row[0] != "setting"] == [
        ["`kvzip` head layerwise=true", "0.1", "0", "`kvzip` head", "100", f"**-100 (p = {2 * 2 * 0.5 ** 10:.2g}, n = 10)**"],
        ["`kvzip` head layerwise=true", "0.1", "0", "`kvzip` head_page", "0", "+0 (p = 1, n = 10)"]]


def test_the_scenarios_runs_are_left_out_and_names_carry_only_what_differs_within_a_model_length_and_mode(
        script, tmp_path):
    """A folder that also holds the scenario grids (perplexity at chunk size 1, multi-turn) and a 100-sample grid at
    another length: those runs are scenario_tables.py's, and a 4,096-token setting's heading and plot name carry no
    field that differs only from settings of another length (the plots' committed names stay the same)."""
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 10, same_everywhere([1] * 10), length=4096)
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 20, same_everywhere([0] * 20))  # 2,048: 20 samples
    write_setting(tmp_path, "ppl", [0.5] * 10, same_everywhere([0.4] * 10), length=512, chunk_size=1)
    write_setting(tmp_path, "ruler:multiturn_niah", [1] * 10, same_everywhere([1] * 10), query_aware=False)
    groups = script.group(script.load([str(tmp_path)]))

    assert {here.setting.task for here in groups} == {"ruler:niah_single_2"}
    assert [here.differs for here in groups] == ["", ""]
    assert sorted(plot.file_name for plot in script.family_plots(groups)) == [
        "granularity-single-needle-smollm2-135m-2048-query-aware.png",
        "granularity-single-needle-smollm2-135m-4096-query-aware.png"]


def test_a_policy_argument_variant_is_a_dotted_line_of_its_scorers_panel(script, tmp_path):
    """KVzip's `layerwise=true` beside its plain cells: one plot (named as without it), the variant a line of the
    scorer's panel, pooled over its own runs only; more scorers than fit a row wrap into rows of four."""
    write_setting(tmp_path, "ruler:niah_single_2", [1] * 10, same_everywhere([1] * 4 + [0] * 6), scorer="kvzip")
    write_run(tmp_path, "ruler:niah_single_2", "kvzip_head", 0.1, [0] * 10, policy_args={"layerwise": "true"})
    for scorer in ("h2o", "snapkv", "tova", "knorm", "keydiff"):
        write_run(tmp_path, "ruler:niah_single_2", f"{scorer}_head", 0.1, [1] * 10)
    groups = script.group(script.load([str(tmp_path)]))
    (plot,) = script.family_plots(groups)

    assert plot.file_name == "granularity-single-needle-smollm2-135m-2048-query-aware.png"
    lines = plot.panels["kvzip"].lines
    assert {line: {b: score for b, (score, _) in points.items()} for line, points in lines.items()} == \
        {**{g: {0.1: 40.0} for g in GRANULARITIES}, "head layerwise=true": {0.1: 0.0}}
    assert plot.panels["kvzip"].full_score == 100.0 and plot.panels["kvzip"].tasks == ["ruler:niah_single_2"]
    (path,) = script.plot_families(groups, tmp_path / "plots")
    height, width, _ = matplotlib.image.imread(path).shape
    assert height / width > 0.3  # six panels in two rows of four, not one row of six (about 0.16)


def test_modes_sets_each_question_seen_run_against_the_same_run_with_the_question_unseen(script, tmp_path):
    for query_aware in (True, False):
        write_run(tmp_path, "ruler:niah_single_1", "full", 1.0, [1] * 10, query_aware=query_aware)
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head", 0.1, [1] * 10, query_aware=True)
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head", 0.1, [0] * 10, query_aware=False)
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head_page", 0.1, [1] * 5 + [0] * 5, query_aware=True)
    # still going with the question unseen: compared on the 6 samples both finished
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head_page", 0.1, [1] * 6, query_aware=False, finished=False,
              samples=10)
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_page", 0.1, [1] * 10, query_aware=True)  # never run unseen
    write_run(tmp_path, "ruler:niah_single_1", "snapkv_head", 0.1, [1] * 10, query_aware=False, length=4096)
    rows = summary_rows(script.mode_table(script.group(script.load([str(tmp_path)]))))

    # 10 samples only the seen run passes: exact McNemar 2 x 0.5^10, Holm over the setting's two tests
    assert [row[1:] for row in rows if row[0] != "setting"] == [
        ["`snapkv` head", "0.1", "100", "0", f"**+100 (p = {2 * 2 * 0.5 ** 10:.2g}, n = 10)**"],
        ["`snapkv` head_page", "0.1", "50", "100", "-17 (p = 1, n = 6)"]]
