"""scripts/scenario_tables.py on tiny run folders written here as the runner writes them (no model): multi-turn,
long-answer and perplexity runs."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from scipy import stats

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "scenario_tables.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("scenario_tables", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scenario_tables"] = module
    spec.loader.exec_module(module)
    return module


def write_run(root: Path, task: str, policy: str, budget: float, records: list[dict], **fields) -> None:
    config = {"task": task, "policy": policy, "budget": budget, "model": "smollm2-135m", "length": 2048,
              "query_aware": False, "granularity": None, "task_args": {}, **fields}
    run = root / f"{task.split(':')[-1]}-{policy}-{budget}-{len(list(root.glob('*'))) if root.exists() else 0}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": config}))
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def conversation(sample: int, scores: list[float], held: float = 0.5) -> dict:
    turns = [{"turn": t + 1, "score": s, "bytes_held": held, "bytes_full": 1.0} for t, s in enumerate(scores)]
    return {"id": f"s{sample}", "score": sum(scores) / len(scores), "turns": turns}


LINES = [f"word{i}: {1000000 + i}" for i in range(4)]


def answer(sample: int, score: float, new_tokens: int, similarity: float = 0.5, exact: int = 4) -> dict:
    """A long-answer record whose answer recites the list's first `exact` lines, then goes wrong."""
    prediction = "\n".join(LINES[:exact] + ["word9: 9"] * (exact < len(LINES))) + "\n</list>"
    return {"id": f"s{sample}", "score": score, "new_tokens": new_tokens, "details": {"edit_similarity": similarity},
            "prediction": prediction, "references": LINES}


def passage(sample: int, nll: float, tokens: int = 10) -> dict:
    return {"id": f"s{sample}", "score": math.exp(nll / tokens), "nll": nll, "scored_tokens": tokens}


def rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| scorer |") and not line.startswith("| policy |")]


def test_multi_turn_runs_are_scored_by_turn_and_their_granularities_tested_on_shared_samples(script, tmp_path):
    task = "ruler:multiturn_niah"
    write_run(tmp_path, task, "full", 1.0, [conversation(i, [1, 1, 0, 1], held=1.0) for i in range(10)],
              task_args={"turns": "4"})
    write_run(tmp_path, task, "h2o_head", 0.5, [conversation(i, [0, 0, 0, 0]) for i in range(10)],
              task_args={"turns": "4"})
    # still going: 8 samples, each turn found
    write_run(tmp_path, task, "h2o_head_page", 0.5, [conversation(i, [1, 1, 1, 1]) for i in range(8)],
              task_args={"turns": "4"})
    runs = script.load([str(tmp_path)], task)

    summary = script.summary(runs)
    assert "### smollm2-135m, 2,048 tokens, question unseen, turns=4: mean over turns, % (n ≥ 8 a cell; " \
           "full cache 75.0)" in summary
    assert rows(summary) == [["h2o", "0.5", "0.0", "100.0", "", ""]]
    table = script.tables(runs)
    # every sample scores 0.75 over its turns: a bootstrap interval of one value
    assert ["full", "1.0", "10", "75.0 (75.0–75.0)", "100.0", "100.0", "0.0", "100.0", "100.0%"] in rows(table)
    # the per-head pages against per-head tokens on the 8 samples both finished: 8 discordant of 8, exact McNemar
    (test,) = [row for row in rows(table) if row[:3] == ["h2o", "head_page", "0.5"]]
    assert test[3:] == ["8", "+100.0", f"{stats.binomtest(8, 8).pvalue:.3g}"]


def test_long_answers_set_each_runs_answer_length_against_the_full_caches_on_shared_samples(script, tmp_path):
    task = "long:recite_list"
    write_run(tmp_path, task, "full", 1.0, [answer(i, 1.0, 100, similarity=0.9) for i in range(4)])
    write_run(tmp_path, task, "snapkv_head", 0.2, [answer(i, 0.25, 150, exact=i % 2) for i in range(4)])
    write_run(tmp_path, task, "snapkv_page", 0.2, [answer(i, 0.5, 50, exact=2) for i in range(2)])  # 2 samples so far
    runs = script.load([str(tmp_path)], task)

    summary = script.summary(runs)
    assert "before the first error (mean; full cache 4.0)" in summary
    assert rows(summary) == [["snapkv", "0.2", "25.0", "", "", "50.0"], ["snapkv", "0.2", "1.50", "", "", "0.50"],
                             ["snapkv", "0.2", "0.5", "", "", "2.0"]]
    table = {row[0]: row for row in rows(script.tables(runs)) if len(row) == 6}
    assert table["full"][4:] == ["90.0", "1.00"]
    assert table["snapkv_head"][4:] == ["50.0", "1.50"]
    # half the samples get the first line right, none the second
    by_policy = {run["config"]["policy"]: run for run in runs}
    assert script.survival(by_policy["snapkv_head"]) == [50.0, 0.0, 0.0, 0.0]
    assert script.survival(by_policy["full"]) == [100.0] * 4
    path = tmp_path / "survival.png"
    script.plot_survival(runs, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_perplexity_runs_show_perplexity_over_all_scored_tokens(script, tmp_path):
    write_run(tmp_path, "ppl", "full", 1.0, [passage(0, 10.0), passage(1, 30.0)], length=512)
    write_run(tmp_path, "ppl", "h2o_token", 0.2, [passage(0, 20.0), passage(1, 40.0)], length=512)
    runs = script.load([str(tmp_path)], "ppl")

    summary = script.summary(runs)
    assert f"full cache {math.exp(2.0):.2f})" in summary  # exp(40 / 20 tokens), not the mean of the two passages
    assert rows(summary) == [["h2o", "0.2", "", "", f"{math.exp(3.0):.2f}", ""]]


def test_a_policy_argument_variant_is_a_row_of_its_own_set_against_its_scorer_at_each_granularity(script, tmp_path):
    """`kvzip_head:layerwise=true` ran beside `kvzip_head`: it is not read as `kvzip_head` (the summary mixed the
    two before), and the tables test it against `kvzip` at every granularity that ran."""
    task = "ruler:multiturn_niah"
    write_run(tmp_path, task, "kvzip_head", 0.2, [conversation(i, [1, 1]) for i in range(10)])
    write_run(tmp_path, task, "kvzip_head_page", 0.2, [conversation(i, [1, 0]) for i in range(10)])
    write_run(tmp_path, task, "kvzip_head", 0.2, [conversation(i, [0, 0]) for i in range(10)],
              policy_args={"layerwise": "true"})
    runs = script.load([str(tmp_path)], task)
    assert rows(script.summary(runs)) == [["kvzip", "0.2", "100.0", "50.0", "", ""],
                                          ["kvzip layerwise=true", "0.2", "0.0", "", "", ""]]
    table = rows(script.tables(runs))
    assert ["kvzip layerwise=true head", "kvzip head", "0.2", "10", "-100.0",
            f"{min(1.0, 2 * stats.binomtest(10, 10).pvalue):.3g}"] in table
    assert [row[:5] for row in table if row[:2] == ["kvzip layerwise=true head", "kvzip head_page"]] == \
        [["kvzip layerwise=true head", "kvzip head_page", "0.2", "10", "-50.0"]]
    # a second variant is a Holm family of its own: the first's adjusted p-values stay as they were
    write_run(tmp_path, task, "kvzip_head_page", 0.2, [conversation(i, [1, 1]) for i in range(10)],
              policy_args={"pool_pages": "true"})
    again = rows(script.tables(script.load([str(tmp_path)], task)))
    assert [row for row in again if row[0] == "kvzip layerwise=true head"] == \
        [row for row in table if row[0] == "kvzip layerwise=true head"]
    assert ["kvzip pool_pages=true head_page", "kvzip head_page", "0.2", "10", "+50.0"] in [row[:5] for row in again]


@pytest.mark.parametrize("task, records", [
    ("ruler:multiturn_niah", [conversation(i, [1, 0]) for i in range(3)]),
    ("long:recite_list", [answer(i, 0.5, 10) for i in range(3)]),
    ("ppl", [passage(i, 5.0) for i in range(3)]),
])
def test_a_plot_is_written_for_each_scenario(script, tmp_path, task, records):
    for policy in ("full", "h2o_head", "h2o_head_page"):
        for budget in ((1.0,) if policy == "full" else (0.2, 0.5)):
            write_run(tmp_path / "runs", task, policy, budget, records)
    write_run(tmp_path / "runs", task, "h2o_head", 0.5, records, policy_args={"normalize": "true"})  # a variant
    write_run(tmp_path / "runs", task, "streaming_llm", 0.2, records)  # a panel with one granularity, drawn last
    path = tmp_path / "figure.png"
    figure = script.plot(script.load([str(tmp_path / "runs")], task), path)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert {axes.get_yscale() for axes in figure.axes} == {"log" if task == "ppl" else "linear"}
    (legend,) = [axes.get_legend() for axes in figure.axes if axes.get_legend() is not None]
    drawn = {line.get_label() for axes in figure.axes for line in axes.get_lines()}
    assert {text.get_text() for text in legend.get_texts()} == drawn  # the legend names every line of the figure


def test_a_model_whose_full_cache_ran_alone_is_one_line_and_never_the_figure(script, tmp_path):
    task = "long:recite_list"
    # Gemma's baseline alone (whether it can do the task), sorted before SmolLM2's grid by name
    write_run(tmp_path, task, "full", 1.0, [answer(i, 0.25, 100) for i in range(4)], model="gemma3-270m")
    write_run(tmp_path, task, "full", 1.0, [answer(i, 1.0, 100) for i in range(4)])
    write_run(tmp_path, task, "snapkv_head", 0.2, [answer(i, 0.5, 100, exact=2) for i in range(4)])
    runs = script.load([str(tmp_path)], task)

    for text in (script.summary(runs), script.tables(runs)):
        assert "### gemma3-270m, 2,048 tokens, question unseen: the full cache alone, 25.0 (n = 4); no policy ran" \
            in text.splitlines()
        assert text.index("### smollm2-135m") < text.index("### gemma3-270m")
    setting, grid = script.by_setting(runs)[0]
    assert setting[0] == "smollm2-135m" and {run["config"]["policy"] for run in grid} == {"full", "snapkv_head"}
    script.plot_survival(runs, tmp_path / "survival.png")
    assert (tmp_path / "survival.png").read_bytes().startswith(b"\x89PNG")


def test_model_keeps_one_models_runs_so_that_a_figure_can_draw_either(script, tmp_path):
    task = "ruler:multiturn_niah"
    for model, found in (("gemma3-270m", 1), ("smollm2-135m", 0)):  # Gemma's grid sorts first by name
        for policy, budget in (("full", 1.0), ("h2o_head", 0.5)):
            write_run(tmp_path, task, policy, budget, [conversation(i, [found] * 4) for i in range(3)], model=model)
    assert script.by_setting(script.load([str(tmp_path)], task))[0][0][0] == "gemma3-270m"
    runs = script.load([str(tmp_path)], task, model="smollm2-135m")
    assert {run["config"]["model"] for run in runs} == {"smollm2-135m"}
    assert "gemma3-270m" not in script.summary(runs)
    figure = script.plot(runs, tmp_path / "turns.png")
    assert figure._suptitle.get_text().startswith("smollm2-135m")
    assert script.load([str(tmp_path)], task, model="llama") == []


def test_a_one_kv_head_models_turns_are_drawn_per_granularity_it_ran(script, tmp_path):
    """Gemma 3 runs per head and per-head pages only (shared units keep what they keep): the figure's mean by turn
    is over the scorers run at both, not over none (no scorer ran at all four)."""
    task = "ruler:multiturn_niah"
    write_run(tmp_path, task, "full", 1.0, [conversation(i, [1, 1]) for i in range(3)], model="gemma3-270m")
    for policy, found in (("h2o_head", [0, 1]), ("h2o_head_page", [1, 1]), ("streaming_llm", [0, 0])):
        write_run(tmp_path, task, policy, 0.5, [conversation(i, found) for i in range(3)], model="gemma3-270m")
    figure = script.plot(script.load([str(tmp_path)], task), tmp_path / "turns.png")
    lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert lines == {"head": [0.0, 100.0], "head_page": [100.0, 100.0], "full cache": [100.0, 100.0]}
    assert figure._suptitle.get_text().endswith("a line per granularity, the mean over h2o")
