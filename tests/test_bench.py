"""`evalkit bench` on a tiny random model: every cell in the JSON, sane numbers, plots, resume, bad input.
Structure only: no assertion here depends on how fast anything ran."""

import json
import math

import pytest
import torch

from conftest import needs_model_files
from evalkit.bench.checks import parse_length
from evalkit.bench.components import (HeadShape, decode_attention_point, fit_power, prefill_statistics_point,
                                      selection_point, summarise)
from evalkit.bench.generations import FULL, HF_LOOP, BenchCell, compare_with_full, grid_cells, targets
from evalkit.bench.isolation import Isolated, PeakMemory
from evalkit.errors import EvalkitError
from helpers import run_cli

LENGTHS = (48, 64)
NEW_TOKENS = 3
POLICIES = ("h2o_head", "streaming_llm")
BUDGET = 0.5
LAYOUTS = ("paged", "dense")
SHAPE = HeadShape(query_heads=6, kv_heads=2, head_dim=16, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama saved with the default model's tokenizer (bench prompts are real text)."""
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def bench_args(model_dir, out_dir, new_tokens=NEW_TOKENS):
    return ["bench", "--model", str(model_dir), "--lengths", ",".join(map(str, LENGTHS)),
            "--new-tokens", str(new_tokens), "--repeats", "1", "--policies", ",".join(POLICIES),
            "--budgets", str(BUDGET), "--layouts", ",".join(LAYOUTS), "--out", str(out_dir)]


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    code, out, err = run_cli(*bench_args(tiny_model_dir, out_dir))
    assert code == 0, err
    return out_dir, json.loads((out_dir / "bench.json").read_text()), out


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_json_has_every_cell_and_the_baselines(bench_run):
    _, result, _ = bench_run
    assert result["complete"]
    keys = {(c["loop"], c["policy"], c["budget"], c["layout"], c["length"]) for c in result["cells"]}
    expected = set()
    for length in LENGTHS:
        expected.add((HF_LOOP, HF_LOOP, 1.0, "hf", length))
        expected |= {("evalkit", FULL, 1.0, layout, length) for layout in LAYOUTS}
        expected |= {("evalkit", policy, BUDGET, layout, length) for policy in POLICIES for layout in LAYOUTS}
    assert keys == expected
    assert len(result["cells"]) == len(expected)


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_numbers_are_sane(bench_run):
    _, result, _ = bench_run
    for cell in result["cells"]:
        assert cell["prompt_tokens"] == cell["length"] - NEW_TOKENS
        assert cell["new_tokens"] == NEW_TOKENS
        for key in ("prefill_seconds", "decode_seconds", "total_seconds", "decode_step_seconds", "tokens_per_s"):
            assert cell[key] > 0, (cell["key"], key)
        assert cell["compression_seconds"] >= 0
        assert cell["total_seconds"] >= cell["prefill_seconds"] + cell["decode_seconds"] - 1e-6
        (repeat,) = cell["repeats"]
        assert len(repeat["decode_steps"]) == NEW_TOKENS - 1  # one forward per token after the first
        assert cell["peak_rss_bytes"] >= cell["base_rss_bytes"] > 0
        assert cell["working_bytes"] == cell["peak_rss_bytes"] - cell["base_rss_bytes"]
        if cell["loop"] == HF_LOOP:
            continue
        assert 0 < cell["bytes_ideal"] <= cell["bytes_full"]
        if cell["layout"] == "paged":
            assert cell["held_over_ideal"] == cell["bytes_held"] / cell["bytes_ideal"] >= 1
            if cell["policy"] == FULL:  # every token, in whole pages of 16
                pages = math.ceil(cell["prompt_tokens"] / 16)
                assert cell["bytes_held"] == pages * 16 * cell["bytes_full"] // cell["prompt_tokens"]
            else:
                assert cell["bytes_held"] <= cell["bytes_full"]
        else:  # the dense buffer is held whole, whatever the policy keeps
            assert cell["bytes_held"] == cell["storage_bytes"] > cell["bytes_full"]
        if cell["policy"] != FULL:
            assert cell["bytes_ideal"] == pytest.approx(BUDGET * cell["bytes_full"], rel=0.1)
            assert set(cell["vs_full"]) == {"tokens_per_s", "decode_step", "prefill_seconds", "peak_rss", "working"}


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_full_cache_loop_reproduces_hf_generate(bench_run):
    _, result, _ = bench_run
    by_key = {c["key"]: c for c in result["cells"]}
    for length in LENGTHS:
        assert by_key[f"evalkit/full/1.0/paged/{length}"]["token_ids"] == by_key[f"hf/hf/1.0/hf/{length}"]["token_ids"]


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_targets_cover_the_grid(bench_run):
    _, result, out = bench_run
    names = {(t["target"], t["cell"]) for t in result["targets"]}
    for length in LENGTHS:
        assert ("full-cache loop tokens/s / HF generate tokens/s", f"evalkit/full/1.0/paged/{length}") in names
        for policy in POLICIES:
            assert ("paged KV bytes held / ideal", f"evalkit/{policy}/{BUDGET}/paged/{length}") in names
            assert ("dense KV bytes held / capacity", f"evalkit/{policy}/{BUDGET}/dense/{length}") in names
        assert ("peak process memory / full cache's", f"evalkit/h2o_head/{BUDGET}/paged/{length}") in names
    dense = [t for t in result["targets"] if t["target"].startswith("dense")]
    assert dense and all(t["met"] for t in dense)
    assert "targets (same run)" in out and "HF generate" in out


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_plots_are_written(bench_run):
    from matplotlib.image import imread

    out_dir, _, _ = bench_run
    for name in ("bench.png", "components.png"):
        image = imread(out_dir / name)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image[..., :3].std() > 0.01  # something drawn, not a blank canvas


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_components_have_every_point_and_fit(bench_run):
    _, result, _ = bench_run
    components = result["components"]
    assert components["sizes"] == list(LENGTHS)
    prefill = components["prefill_statistics"]
    labels = {f"{c} (flash+tiles)" for c in ("none", "attention", "window")}  # the CPU's one prefill route
    assert {(p["collect"], p["n"]) for p in prefill["points"]} == {(c, n) for c in labels for n in LENGTHS}
    assert set(prefill["fits"]) == labels
    for fits in prefill["fits"].values():
        assert fits["time"]["exponent"] == pytest.approx(math.log2(fits["time"]["per_doubling"]))
    assert {(p["policy"], p["n"]) for p in components["selection"]["points"]} == {
        (policy, n) for policy in POLICIES for n in LENGTHS}
    decode = components["decode_attention"]
    assert decode["fits"]["fixed_length"] == max(LENGTHS)
    assert {p["n"] for p in decode["points"] if p["kept"] == decode["fits"]["fixed_kept"]} == set(LENGTHS)


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_rerun_measures_only_what_is_missing(bench_run, tiny_model_dir):
    out_dir, result, _ = bench_run
    code, _, err = run_cli(*bench_args(tiny_model_dir, out_dir))
    assert code == 0, err
    again = json.loads((out_dir / "bench.json").read_text())
    assert f"{len(result['cells'])} already measured" in err
    assert [c["measured_at"] for c in again["cells"]] == [c["measured_at"] for c in result["cells"]]
    assert again["components"]["prefill_statistics"] == result["components"]["prefill_statistics"]


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_results_of_other_settings_are_not_mixed_in(bench_run, tiny_model_dir):
    out_dir, _, _ = bench_run
    before = (out_dir / "bench.json").read_text()
    code, _, err = run_cli(*bench_args(tiny_model_dir, out_dir, new_tokens=NEW_TOKENS + 1))
    assert code == 2
    assert "measured with other settings" in err and len(err.strip().splitlines()) == 1
    assert (out_dir / "bench.json").read_text() == before


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
@pytest.mark.parametrize("args, message", [
    (["--policies", "h2o_haed"], "unknown policy 'h2o_haed' (did you mean 'h2o_head'?)"),
    (["--policies", "h2o_head,,snapkv"], "without empty items"),
    (["--lengths", "abc"], "length must be a positive integer"),
    (["--lengths", "1.5k"], "length must be a positive integer"),
    (["--lengths", "0"], "length must be a positive integer"),
    (["--lengths", "40"], "fewer than 32 prompt tokens"),
    (["--lengths", "1k"], "exceeds the 512 positions"),
    (["--budgets", "0"], "budget must be > 0"),
    (["--budgets", "-0.5"], "out of range"),
    (["--budgets", "0.2,1.5"], "out of range"),
    (["--layouts", "sparse"], "unknown layout 'sparse'"),
    (["--new-tokens", "1"], "new-tokens must be >= 2"),
    (["--repeats", "0"], "repeats must be >= 1"),
    (["--threads", "-1"], "threads must be >= 0"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tiny_model_dir, tmp_path, args, message):
    out_dir = tmp_path / "bench"
    code, _, err = run_cli("bench", "--model", str(tiny_model_dir), "--lengths", "64", *args, "--out", str(out_dir))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out_dir.exists()


def test_missing_model_is_refused(tmp_path):
    code, _, err = run_cli("bench", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "bench"))
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1


# --- pieces -------------------------------------------------------------------------------------------

def test_parse_length():
    assert parse_length("512") == 512
    assert parse_length("2k") == parse_length(" 2K ") == 2048
    for bad in ("", "k", "2m", "-1", "1.5k", "0k"):
        with pytest.raises(EvalkitError):
            parse_length(bad)


def test_fit_power_recovers_exponents():
    sizes = [256, 512, 1024, 2048]
    quadratic = fit_power(sizes, [3e-9 * n**2 for n in sizes])
    assert quadratic["exponent"] == pytest.approx(2.0)
    assert quadratic["per_doubling"] == pytest.approx(4.0)
    assert [r["ratio"] for r in quadratic["ratios"]] == pytest.approx([4.0, 4.0, 4.0])
    assert fit_power(sizes, [7.0] * 4)["exponent"] == pytest.approx(0.0)
    assert fit_power([512, 512], [1.0, 2.0]) is None  # one distinct size: no slope
    assert fit_power([512], [1.0]) is None


def test_grid_has_baselines_before_policies_per_length():
    cells = grid_cells(["h2o_head", "full"], [0.2, 0.5], ["paged", "dense"], [1024, 2048])
    first = cells[:7]
    assert [c.policy for c in first] == [HF_LOOP, FULL, FULL, "h2o_head", "h2o_head", "h2o_head", "h2o_head"]
    assert len(cells) == 2 * (1 + 2 + 2 * 2)  # "full" in --policies is the baseline, not a second row
    assert len({c.key for c in cells}) == len(cells)


def _row(policy, length, layout="paged", budget=0.2, **fields):
    cell = BenchCell("hf" if policy == HF_LOOP else "evalkit", policy, budget, layout, length)
    base = {"loop": cell.loop, "policy": policy, "budget": budget, "layout": layout, "length": length,
            "key": cell.key, "label": cell.label, "tokens_per_s": 10.0, "decode_step_seconds": 0.1,
            "prefill_seconds": 1.0, "compression_seconds": 0.0, "peak_rss_bytes": 1000, "working_bytes": 100,
            "token_ids": [1, 2], "prompt_tokens": 1000, "new_tokens": 2, "kept_tokens": 1000.0,
            "bytes_held": 1000, "bytes_ideal": 1000, "bytes_full": 1000, "storage_bytes": 1000,
            "held_over_ideal": 1.0}
    base.update(fields)
    return base


def test_targets_compare_against_the_full_cache_of_the_same_length_and_layout():
    rows = [_row(HF_LOOP, 8192, layout="hf", tokens_per_s=10.0),
            _row(FULL, 8192, tokens_per_s=9.5, decode_step_seconds=0.2, peak_rss_bytes=1000),
            _row("h2o_head", 8192, decode_step_seconds=0.1, peak_rss_bytes=1300, kept_tokens=200.0,
                 bytes_held=208, bytes_ideal=200, held_over_ideal=1.04),
            _row(FULL, 8192, layout="dense", decode_step_seconds=1.0, storage_bytes=1010, bytes_held=1010),
            _row("h2o_head", 8192, layout="dense", decode_step_seconds=0.9, bytes_held=1010, storage_bytes=1010,
                 bytes_ideal=200)]
    compare_with_full(rows)
    assert rows[2]["vs_full"]["decode_step"] == pytest.approx(0.5)
    assert rows[4]["vs_full"]["decode_step"] == pytest.approx(0.9)  # against the dense full cache
    found = {(t["target"], t["layout"]): t for t in targets(rows, {"h2o_head"}, block_size=16)}
    assert found[("full-cache loop tokens/s / HF generate tokens/s", "paged")]["met"]
    assert found[("full-cache loop tokens/s / HF generate tokens/s", "paged")]["value"] == pytest.approx(0.95)
    assert found[("decode step / full-cache decode step", "paged")]["met"]
    assert not found[("decode step / full-cache decode step", "dense")]["met"]
    assert found[("paged KV bytes held / ideal", "paged")]["met"]
    assert found[("dense KV bytes held / capacity", "dense")]["met"]
    memory = found[("peak process memory / full cache's", "paged")]
    assert memory["value"] == pytest.approx(1.3) and not memory["met"]


def test_decode_attention_reads_the_kept_pages_only():
    for n in (64, 256):
        point = decode_attention_point(SHAPE, n, kept=20, page_size=16)
        assert point["slots_read"] == 32  # ceil(20 / 16) pages after compaction, whatever n
        assert point["seconds"] > 0


def test_prefill_statistics_and_selection_points():
    point = prefill_statistics_point(SHAPE, 64, "attention", "flash+tiles")
    assert point["collect"] == "attention (flash+tiles)" and point["n"] == 64 and point["seconds"] > 0
    with pytest.raises(ValueError, match="does not run on cpu"):
        prefill_statistics_point(SHAPE, 64, "attention", "sdpa")
    assert point["peak_rss_bytes"] >= point["base_rss_bytes"]
    chosen = selection_point(SHAPE, "h2o_head", 100, 0.25)
    assert chosen["kept"] == 25 and chosen["seconds"] > 0


def test_summarise_groups_points_and_fits_them():
    sizes = [64, 128]
    results = {
        "prefill_statistics": [{"n": n, "collect": f"{c} (flash+tiles)", "route": "flash+tiles",
                                "seconds": n * n * 1e-6, "working_bytes": n * 100}
                               for c in ("none", "attention") for n in sizes],
        "selection": [{"policy": "h2o_head", "n": n, "budget": 0.2, "kept": n // 5, "seconds": n * 1e-6}
                      for n in sizes],
        "decode_attention": [{"n": 64, "kept": 13, "seconds": 1e-4}, {"n": 128, "kept": 13, "seconds": 1e-4},
                             {"n": 128, "kept": 64, "seconds": 4e-4}],
    }
    summary = summarise(results, sizes)
    fits = summary["prefill_statistics"]["fits"]["attention (flash+tiles)"]
    assert fits["time"]["exponent"] == pytest.approx(2.0)
    assert fits["working_memory"]["exponent"] == pytest.approx(1.0)
    assert summary["selection"]["fits"]["h2o_head"]["exponent"] == pytest.approx(1.0)
    assert summary["decode_attention"]["fits"]["over_length_at_fixed_kept"]["exponent"] == pytest.approx(0.0)
    assert summary["decode_attention"]["fits"]["fixed_kept"] == 13
    assert summary["prefill_statistics"]["overhead_over_plain"] == [
        {"n": n, "collect": "attention (flash+tiles)", "ratio": pytest.approx(1.0)} for n in sizes]


def _peaks_around_a_freed_block(mib: int) -> tuple[int, int]:
    """(working bytes while a `mib` MiB block lived and died, working bytes of doing nothing after)."""
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    block = torch.ones(mib * 2**20 // 4)  # touched, so resident
    del block
    with_block = memory.read()["working_bytes"]
    memory.reset()
    return with_block, memory.read()["working_bytes"]


@pytest.mark.slow  # a second Python that imports torch
def test_peak_memory_sees_a_freed_block_and_resets():
    with Isolated() as isolated:  # PeakMemory changes how its process allocates: not in pytest's
        with_block, idle = isolated.run(1, _peaks_around_a_freed_block, 64)
    assert 64 * 2**20 <= with_block < 80 * 2**20
    assert idle < 4 * 2**20


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
@pytest.mark.skipif(torch.cuda.is_available(), reason="refusing CUDA needs a machine without it")
def test_cuda_without_cuda_is_refused(tiny_model_dir, tmp_path):
    code, _, err = run_cli("bench", "--model", str(tiny_model_dir), "--device", "cuda", "--out", str(tmp_path / "b"))
    assert code == 2 and "CUDA is not available" in err and len(err.strip().splitlines()) == 1


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_granularities_are_cells_of_their_own_with_eviction_timed(tiny_model_dir, tmp_path):
    code, out, err = run_cli("bench", "--model", str(tiny_model_dir), "--lengths", "72", "--new-tokens", "4",
                             "--repeats", "1", "--policies", "h2o_head", "--budgets", "32",
                             "--granularities", "head,head_page,token,page", "--block-size", "8",
                             "--no-components", "--out", str(tmp_path))
    assert code == 0, err
    rows = {r["granularity"]: r for r in json.loads((tmp_path / "bench.json").read_text())["cells"]
            if r["loop"] == "evalkit" and r["policy"] == "h2o_head"}
    assert set(rows) == {"head", "head_page", "token", "page"}
    for granularity, row in rows.items():
        assert 32 - 7 <= row["kept_tokens"] <= 32, granularity
        assert row["decode_eviction_seconds"] > 0  # budget 32 of 68: every decode step evicts
        assert row["decode_eviction_seconds"] < row["decode_step_seconds"]
        # Paged storage holds whole pages: at most one partly filled page per head above the ideal.
        assert row["held_over_ideal"] <= math.ceil(row["kept_tokens"] / 8) * 8 / row["kept_tokens"] + 1e-9
    assert rows["head_page"]["label"] == "h2o_head[head_page] @ 32"


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_an_unsupported_granularity_is_refused(tiny_model_dir, tmp_path):
    code, _, err = run_cli("bench", "--model", str(tiny_model_dir), "--policies", "quest",
                           "--granularities", "head_page", "--out", str(tmp_path / "b"))
    assert code == 2 and "quest cannot run at granularity head_page" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()
