"""`niah`: the grid's settings, its samples (needle placement, fitted lengths), heatmaps, and a real run."""

import json
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import needs_model_files
from evalkit.assets import default_model_dir
from evalkit.cli import main
from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.report.heatmap import load_run, side_by_side_figure, write_side_by_side
from evalkit.runner import run
from evalkit.tasks import TASKS
from evalkit.tasks.haystack import essay_words
from evalkit.tasks.niah_grid import (FACTS, MIN_LENGTH, NEEDLE, NiahGrid, default_lengths, needle_word_index,
                                     parse_depths, parse_lengths)
from evalkit.tasks.niah_heatmap import draw_grid, run_title, score_grid, write_heatmap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
@needs_model_files  # the default model's tokenizer
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def prompt_length(tokenizer):
    from evalkit.prompt import prompt_length

    return prompt_length(tokenizer)


# --- settings --------------------------------------------------------------------------------

def test_lengths_and_depths_parse_and_bad_values_are_refused():
    assert parse_lengths("1k,2k,3000, 1.5k") == (1024, 1536, 2048, 3000)
    assert parse_depths("100,0,50,12.5") == (0.0, 12.5, 50.0, 100.0)
    for text, message in [("1k,2x", "niah lengths must be whole token counts like 2048 or 2k, got '2x'"),
                          ("1.3k", "got '1.3k'"), ("100", f"niah length 100 is below the minimum of {MIN_LENGTH}"),
                          ("1k,,2k", "comma-separated list"), ("", "comma-separated list")]:
        with pytest.raises(EvalkitError, match=message):
            parse_lengths(text)
    for text, message in [("0,101", "niah depth 101 is outside 0..100"), ("-5", "outside 0..100"),
                          ("half", "niah depths must be numbers from 0 to 100, got 'half'")]:
        with pytest.raises(EvalkitError, match=message):
            parse_depths(text)


def test_the_grid_defaults_to_four_lengths_up_to_length_and_five_depths():
    task = TASKS.create("niah")
    assert task.grid(2048) == ((512, 1024, 1536, 2048), (0.0, 25.0, 50.0, 75.0, 100.0))
    assert default_lengths(600) == (256, 371, 485, 600)  # never below the minimum
    assert default_lengths(MIN_LENGTH) == (MIN_LENGTH,)
    with pytest.raises(EvalkitError, match=f"niah needs --length >= {MIN_LENGTH}"):
        default_lengths(200)
    tuned = task.with_args({"lengths": "1k,2k", "depths": "0,100"})
    assert tuned.grid(4096) == ((1024, 2048), (0.0, 100.0))  # explicit lengths: --length is not used
    with pytest.raises(EvalkitError, match="unknown niah task-arg lenghts; known: depths, lengths"):
        task.with_args({"lenghts": "1k"})


# --- placement -------------------------------------------------------------------------------

def test_the_needle_walks_back_to_just_after_the_previous_period():
    words = "One two. Three four five. Six seven eight nine ten.".split()
    assert needle_word_index(words, 0) == 0
    assert needle_word_index(words, 10) == 0  # before "two.", no period behind: the start
    assert needle_word_index(words, 40) == 2  # before "four": back to just after "two."
    assert needle_word_index(words, 50) == 5  # already just after "five."
    assert needle_word_index(words, 60) == 5  # before "seven": back to just after "five."
    assert needle_word_index(words, 100) == len(words)  # the very end, as gkamradt does
    assert needle_word_index("no period at all here".split(), 80) == 0


@pytest.fixture(scope="module")
def grid_samples(prompt_length):
    task = NiahGrid(lengths=(512, 1024), depths=(0.0, 33.0, 100.0))
    return task, task.samples(prompt_length, 2048, 12, seed=5)


@pytest.mark.model  # tokenizer: the default model's tokenizer
def test_every_cell_gets_the_same_number_of_samples(grid_samples, prompt_length):
    task, samples = grid_samples
    # 12 samples over 6 cells: two each.
    cells = [(s.meta["length"], s.meta["depth"], s.meta["repeat"]) for s in samples]
    assert sorted(cells) == sorted((length, depth, repeat) for length in (512, 1024) for depth in (0.0, 33.0, 100.0)
                                   for repeat in (0, 1))
    assert len({s.id for s in samples}) == 12 and samples[0].id == "niah-512-0-0"
    assert len(NiahGrid(lengths=(512,), depths=(50.0,)).samples(prompt_length, 600, 1, 0)) == 1


@pytest.mark.model  # tokenizer: the default model's tokenizer
def test_samples_are_deterministic_for_a_seed(grid_samples, prompt_length):
    task, samples = grid_samples
    assert task.samples(prompt_length, 2048, 12, seed=5) == samples
    other = task.samples(prompt_length, 2048, 12, seed=6)
    # The first needle of a cell starts the haystack at the essays' beginning whatever the seed; the others move.
    assert [s.context for s in other if s.meta["repeat"] == 0] == [s.context for s in samples if s.meta["repeat"] == 0]
    assert [s.context for s in other if s.meta["repeat"] == 1] != [s.context for s in samples if s.meta["repeat"] == 1]


@pytest.mark.model  # tokenizer: the default model's tokenizer
def test_prompts_fill_their_cell_length(grid_samples, prompt_length):
    _, samples = grid_samples
    for sample in samples:
        length = sample.meta["length"]
        used = prompt_length(sample) + sample.max_new_tokens
        assert length - max(4, (length - sample.max_new_tokens) // 200) <= used <= length


@pytest.mark.model  # tokenizer: the default model's tokenizer
def test_the_needle_sits_once_at_its_depth_after_a_sentence_end(grid_samples):
    _, samples = grid_samples
    words = essay_words()
    for sample in samples:
        meta = sample.meta
        assert sample.context.count(NEEDLE) == 1 and sample.references == FACTS
        haystack = sample.context.split("<context>\n")[1].split("\n</context>")[0]
        before, after = haystack.split(NEEDLE)
        before_words = before.split()
        assert len(before_words) == meta["needle_word"]
        assert len(before_words) + len(after.split()) == meta["haystack_words"]
        expected = [words[(meta["haystack_start"] + i) % len(words)] for i in range(meta["haystack_words"])]
        assert before_words + after.split() == expected  # the haystack is the essays, from its start word
        target = meta["haystack_words"] if meta["depth"] == 100 else int(meta["haystack_words"] * meta["depth"] / 100)
        assert meta["needle_word"] <= target
        if 0 < meta["depth"] < 100:  # depth 100 is the very end, where the haystack was cut, mid-sentence or not
            assert before_words[-1].endswith(".")
        assert not any(w.endswith(".") for w in expected[meta["needle_word"]:target])  # no nearer period skipped
        assert target - meta["needle_word"] < 60  # back one sentence at most
        assert meta["needle_depth"] == pytest.approx(100 * meta["needle_word"] / meta["haystack_words"])
        assert (meta["needle_word"] == 0) == (meta["depth"] == 0)


def test_score_is_the_share_of_the_needle_facts_found():
    task = NiahGrid()
    assert FACTS == ["sandwich", "Dolores Park"]  # gkamradt's needle's two facts
    assert task.score("Eat a sandwich and sit in Dolores Park.", FACTS) == 1.0
    assert task.score("Sit in dolores park on a sunny day", FACTS) == 0.5
    assert task.score("Visit the Golden Gate Bridge.", FACTS) == 0.0


# --- heatmaps --------------------------------------------------------------------------------

def record(length, depth, score, repeat=0):
    return {"id": f"niah-{length}-{depth:g}-{repeat}", "score": score, "meta": {"length": length, "depth": depth}}


RECORDS = [record(512, 0.0, 1.0), record(512, 0.0, 0.5, repeat=1), record(512, 50.0, 0.0), record(1024, 0.0, 0.5),
           record(1024, 100.0, 1.0)]  # ids unique, as in a run (a repeated id is a resumed run's duplicate)


def test_the_score_grid_is_the_mean_per_depth_and_length():
    grid = score_grid(RECORDS)
    assert grid.lengths == (512, 1024) and grid.depths == (0.0, 50.0, 100.0)
    np.testing.assert_array_equal(grid.scores, [[0.75, 0.5], [0.0, np.nan], [np.nan, 1.0]])
    np.testing.assert_array_equal(grid.counts, [[2, 1], [1, 0], [0, 1]])
    with pytest.raises(EvalkitError, match="not a niah grid run"):
        score_grid([{"id": "x", "score": 1.0, "meta": {"depth": 10}}], "runs/x")


def test_the_drawn_image_holds_the_scores_on_a_fixed_scale():
    from matplotlib.figure import Figure

    grid = score_grid(RECORDS)
    image = draw_grid(Figure().add_subplot(), grid, "full @ 1.0")
    np.testing.assert_array_equal(np.ma.filled(image.get_array(), np.nan), grid.scores)
    assert image.get_clim() == (0.0, 1.0)
    assert [t.get_text() for t in image.axes.get_xticklabels()] == ["512", "1024"]
    assert [t.get_text() for t in image.axes.get_yticklabels()] == ["0", "50", "100"]
    assert sorted(t.get_text() for t in image.axes.texts) == ["0", "100", "50", "75"]  # percent in the cells


def png_size(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as picture:
        picture.verify()
    with Image.open(path) as picture:
        return picture.size


def test_write_heatmap_writes_a_png(tmp_path):
    path = write_heatmap(RECORDS, tmp_path / "sub" / "heatmap.png", "h2o_head @ 0.2")
    width, height = png_size(path)
    assert 300 < width < 2000 and 200 < height < 2000 and path.stat().st_size > 5_000
    assert not list(tmp_path.rglob("*.tmp"))


def fake_run(folder, policy, budget, records, **config):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": {"policy": policy, "budget": budget, **config}}))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_side_by_side_draws_one_panel_per_run_on_one_scale(tmp_path):
    full = fake_run(tmp_path / "a", "full", 1.0, RECORDS)
    h2o = fake_run(tmp_path / "b", "h2o_head", 0.2, [dict(r, score=r["score"] / 2) for r in RECORDS])
    snap = fake_run(tmp_path / "c", "snapkv", 0.2, RECORDS[:2], granularity="page", query_aware=False)
    figure = side_by_side_figure([full, h2o, snap])
    images = [image for axes in figure.axes for image in axes.get_images()]
    assert [image.axes.get_title() for image in images] == ["full @ 1.0", "h2o_head @ 0.2",
                                                            "snapkv [page] @ 0.2, query-agnostic"]
    assert all(image.get_clim() == (0.0, 1.0) for image in images)
    np.testing.assert_array_equal(np.ma.filled(images[1].get_array(), np.nan), score_grid(RECORDS).scores / 2)
    assert len(figure.axes) == 4  # three panels and the one colour bar they share

    single = png_size(write_heatmap(RECORDS, tmp_path / "one.png", "full @ 1.0"))
    width, height = png_size(write_side_by_side([full, h2o, snap], tmp_path / "all.png"))
    assert width > 2 * single[0] and height >= single[1] * 0.8
    with pytest.raises(EvalkitError, match="is not a run folder"):
        write_side_by_side([tmp_path / "missing"], tmp_path / "x.png")
    with pytest.raises(EvalkitError, match="no run folders"):
        write_side_by_side([], tmp_path / "x.png")


def test_run_titles_name_policy_and_budget():
    assert run_title({"policy": "full", "budget": 1.0}) == "full @ 1.0"
    assert run_title({"policy": "h2o_head", "budget": 256, "granularity": "token"}) == "h2o_head [token] @ 256"


# --- runs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--task-arg", "size=3"], "unknown niah task-arg size; known: depths, lengths"),
    (["--task-arg", "lengths=128"], f"niah length 128 is below the minimum of {MIN_LENGTH} tokens"),
    (["--task-arg", "depths=0,120"], "niah depth 120 is outside 0..100"),
    (["--length", "200"], f"niah needs --length >= {MIN_LENGTH}"),
    pytest.param(["--task-arg", "lengths=9k", "--task-arg", "depths=50"], "has 8192: lower the task's lengths",
                 marks=pytest.mark.model),  # the default model's window (its config.json)
])
def test_bad_input_is_one_line_and_exit_2_with_no_run_folder(monkeypatch, capsys, tmp_path, args, message):
    out = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["evalkit", "run", "--task", "niah", *args, "--out", str(out), "--wandb", "off"])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.model  # runs the default model
def test_a_grid_run_on_the_default_model_writes_its_heatmap(tmp_path):
    config = RunConfig(policy="full", budget=1.0, task="niah", task_args={"lengths": "300,400", "depths": "50"},
                       samples=1, out=str(tmp_path), wandb="off")
    result = run(config)
    folder = tmp_path / result.run_id
    records, title = load_run(folder)
    assert title == "full @ 1.0" and len(records) == 2 == result.metrics["samples"]
    assert [(r["meta"]["length"], r["meta"]["depth"]) for r in records] == [(300, 50.0), (400, 50.0)]
    assert result.metrics["metric"] == "string_match_all" and result.metrics["higher_is_better"] is True
    # Each sample scores the share of the needle's two facts its answer names, ignoring case; the run, their mean.
    for r in records:
        answer = r["prediction"].lower()
        assert r["score"] == (("sandwich" in answer) + ("dolores park" in answer)) / 2
    assert result.metrics["score"] == pytest.approx(sum(r["score"] for r in records) / 2)
    png_size(folder / "heatmap.png")
    assert (folder / "metrics.json").exists() and not list(folder.glob("*.tmp"))


def test_heatmap_command_writes_the_side_by_side_png(monkeypatch, capsys, tmp_path):
    full = fake_run(tmp_path / "a", "full", 1.0, RECORDS)
    h2o = fake_run(tmp_path / "b", "h2o_head", 0.2, RECORDS[:2])
    target = tmp_path / "both.png"
    monkeypatch.setattr(sys, "argv", ["evalkit", "heatmap", str(full), str(h2o), "-o", str(target)])
    main()
    assert f"wrote {target}" in capsys.readouterr().out.replace("\n", "")
    assert png_size(target)[0] > png_size(write_heatmap(RECORDS, tmp_path / "one.png", "full @ 1.0"))[0]
    monkeypatch.setattr(sys, "argv", ["evalkit", "heatmap", str(tmp_path / "missing"), "-o", str(target)])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and "is not a run folder" in err and len(err.strip().splitlines()) == 1
