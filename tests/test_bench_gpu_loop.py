"""scripts/bench_gpu_loop.py --tiny end to end on the CPU: every row, real numbers, full cache = HF generate token
for token, KV held under budget, the batch fit consistent with the caches the loop really built, the JSON.
Structure only: no assertion depends on how fast anything ran (ratios are reported, not asserted)."""

import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu_loop.py"
BATCHES = (1, 2)
NEW_TOKENS = 8
PROMPT = 512
ROWS = ("HF generate", "full", "h2o_head @ 0.2", "h2o_head_page @ 0.2", "snapkv_head_page @ 0.2")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def run_main(script, *argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = script.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def tiny_run(script, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_gpu_loop") / "tiny.json"
    code, out, err = run_main(script, "--tiny", "--threads", "1", "--out", str(path))
    assert code == 0, err
    return json.loads(path.read_text()), out


def rows_by_key(document) -> dict:
    return {(row["label"], row["batch"]): row for row in document["rows"]}


@pytest.mark.slow  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
def test_every_row_is_there_with_finite_positive_numbers(tiny_run):
    document, out = tiny_run
    assert document["complete"] and document["plan"]["tiny"]
    rows = rows_by_key(document)
    assert set(rows) == {(label, batch) for label in ROWS for batch in BATCHES}
    for (label, batch), row in rows.items():
        assert row["prompt_tokens_each"] == PROMPT and row["prompt_tokens"] == batch * PROMPT
        assert row["new_tokens"] == batch * NEW_TOKENS  # EOS disabled: exactly the asked number
        for key in ("prefill_seconds", "decode_step_seconds", "tokens_per_s", "peak_rss_bytes", "kv_bytes_held"):
            assert math.isfinite(row[key]) and row[key] > 0, (label, batch, key, row[key])
        if label != "HF generate":
            assert set(row["vs_hf"]) == {"tokens_per_s", "decode_step", "prefill", "same_tokens"}
            assert all(math.isfinite(v) and v > 0 for k, v in row["vs_hf"].items() if k != "same_tokens")
        assert label in out


@pytest.mark.slow  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
def test_full_cache_generates_what_hf_generate_generates(tiny_run):
    """Greedy on the same random weights: the equivalence that makes the speed comparison fair."""
    rows = rows_by_key(tiny_run[0])
    for batch in BATCHES:
        full, hf = rows[("full", batch)], rows[("HF generate", batch)]
        assert len(hf["token_ids"]) == NEW_TOKENS
        assert full["token_ids"] == hf["token_ids"] and full["vs_hf"]["same_tokens"]


@pytest.mark.slow  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
def test_kv_held_at_the_budget_is_below_the_full_cache(tiny_run, script):
    document = tiny_run[0]
    rows = rows_by_key(document)
    config = script.tiny_config()
    for batch in BATCHES:
        full = rows[("full", batch)]["kv_bytes_held"]
        # HF's cache holds the prompt; evalkit's full cache the prompt in whole pages (512 = 32 pages of 16)
        assert rows[("HF generate", batch)]["kv_bytes_held"] == full == \
            batch * PROMPT * script.kv_bytes_per_token(config, torch.float32)
        for label in ROWS[2:]:
            held = rows[(label, batch)]["kv_bytes_held"]
            assert 0 < held < full / 2, (label, batch)  # 0.2 of the prompt, in pages


@pytest.mark.slow  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
def test_the_batch_fit_is_what_the_built_cache_held(tiny_run):
    document = tiny_run[0]
    plan = document["plan"]
    full, budgeted, full_prefill = document["fits"][str(PROMPT)]
    for entry in (full, budgeted, full_prefill):
        pages_per_sequence = entry["kv_heads"] * entry["pages_per_head"]
        assert entry["sequence_bytes"] == pages_per_sequence * entry["page_bytes"] * entry["layers"]
        layer_page = entry["page_bytes"] * entry["layers"]  # one page in every layer's pool
        assert entry["pool_kv_bytes"] <= plan["pool_bytes"] < entry["pool_kv_bytes"] + layer_page
        # the largest batch: this many sequences' pages fit the pool, one more do not
        assert entry["batch"] * pages_per_sequence <= entry["pool_pages_per_layer"] < \
            (entry["batch"] + 1) * pages_per_sequence
    assert budgeted["prefill"] == "chunked" and full_prefill["batch"] == full["batch"]
    assert budgeted["batch"] > full["batch"] >= 1
    for entry in (full, budgeted):
        run = entry["check"]["run"]
        assert run["fits"] and run["batch"] == run["cache_batch"] == entry["batch"]
        assert run["pool_pages_built"] == entry["pool_pages_per_layer"]  # KVCache.create(..., pool_pages=...)
        assert run["new_tokens"] == entry["batch"] * NEW_TOKENS
        # within the loop's own sizing, so within the pool
        assert 0 < run["peak_pages_used"] <= entry["batch"] * entry["kv_heads"] * entry["pages_per_head"]
    assert not full["check"]["one_more"]["fits"]  # the full cache's accounting is exact: one more runs out
    assert "exhausted" in full["check"]["one_more"]["error"]


@pytest.mark.slow  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
def test_targets_are_printed_met_or_not(tiny_run):
    document, out = tiny_run
    names = {t["target"].split(" at ")[0].split(" in ")[0] for t in document["targets"]}
    assert len(names) == 4, names
    assert all(math.isfinite(t["value"]) for t in document["targets"])
    assert "targets (issue 33" in out and ("met" in out or "not met" in out)
    assert "largest batch whose KV fits" in out


def test_accounting_is_the_loops_own_cache_sizing(script):
    """pages_per_head equals the pages per head the loop gives a one-sequence cache when no pool is set."""
    from evalkit.bench.generations import random_model, random_prompts
    from evalkit.loop import GenerationSettings, Request, generate
    from evalkit.policies import make_policy

    config = script.tiny_config()
    config.num_hidden_layers = 1
    model = random_model(config, "float32", "cpu", 0)
    prompt, new, block, chunk = 96, 3, 16, 16
    ids = random_prompts(config.vocab_size, prompt, 1, 0)[0].context_ids
    for policy, budget, prefill in (("full", 1.0, "full"), ("h2o_head_page", 0.2, "chunked"),
                                    ("h2o_head", 0.2, "chunked"), ("h2o_head_page", 0.2, "full")):
        pages = []
        settings = GenerationSettings(make_policy(policy), budget=budget, page_size=block, prefill=prefill,
                                      chunk_size=chunk)
        generate(model, None, [Request(ids, [], new)], settings,
                 observe=lambda event, cache: pages.append(cache.layers[0].pool.num_pages))
        expected = script.pages_per_head(config, policy, budget, prompt, new, block, prefill, chunk)
        assert pages[0] == config.num_key_value_heads * expected, (policy, prefill)


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--budget", "1.5"], "--budget"),
    (["--tiny", "--lengths", "5x"], "length must be"),
    (["--tiny", "--fit-policy", "no_such_policy"], "no_such_policy"),
    (["--tiny", "--lengths", "200k"], "positions"),
])
def test_bad_input_is_one_line_and_exit_2(script, tmp_path, argv, message):
    code, out, err = run_main(script, *argv, "--out", str(tmp_path / "x.json"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_the_8b_shape_is_refused_on_a_cpu(script, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    code, _, err = run_main(script, "--out", str(tmp_path / "x.json"))
    assert code == 2 and "--tiny" in err


def test_the_8b_config_has_llama_31_shape(script):
    """Built on the meta device (no memory), the config's model has Llama-3.1-8B's published parameter count,
    8,030,261,248: a wrong width, depth, head or vocabulary size would not."""
    from transformers import LlamaForCausalLM

    config = script.llama_8b_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    assert config.max_position_embeddings >= 65536 and config.head_dim == 128
    tiny = script.tiny_config()
    assert tiny.num_attention_heads // tiny.num_key_value_heads == 2 and tiny.rope_parameters == config.rope_parameters
