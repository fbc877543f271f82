"""Fuzzed command lines and store files for run, sweep, bench, lm-eval, report and heatmap.

Every outcome is exit 0, or exit 2 with exactly one line on stderr; never a traceback, and a refused
command leaves no file behind. Parsing and validation only: whatever starts the work (the model loader,
bench's measuring, lm-eval's own CLI) raises `ReachedWork`, so reaching it means every check passed.
"""

import json
import os
import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import evalkit

# Examples per command: together well under a minute on a busy 2-core machine.
EXAMPLES = {"run": 60, "sweep": 40, "bench": 30, "lm-eval": 40, "report": 10, "heatmap": 20}


class ReachedWork(Exception):
    """Raised where the work would start: every check passed."""


def _reached(*_, **__):
    raise ReachedWork


@pytest.fixture
def guarded(monkeypatch, tmp_path_factory):
    """The work replaced by ReachedWork; W&B with no credentials and no route; a tiny model folder."""
    import lm_eval.__main__

    from evalkit import models, runner
    from evalkit.bench import command as bench

    monkeypatch.setattr(runner, "load_model", _reached)
    monkeypatch.setattr(models, "load_model", _reached)
    monkeypatch.setattr(bench, "_run", _reached)
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", _reached)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("NETRC", str(tmp_path_factory.mktemp("home") / "no-netrc"))
    folder = tmp_path_factory.mktemp("tiny-model")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512,
                                                    "hidden_size": 64, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "num_hidden_layers": 2,
                                                    "intermediate_size": 64, "vocab_size": 128}))
    return folder


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def outcome(monkeypatch, capsys, root: Path, argv: list[str]) -> tuple[str, str]:
    """Runs `evalkit ARGV` in `root`; checks the contract; returns (outcome, stderr)."""
    capsys.readouterr()
    before = files_under(root)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code, _, err = evalkit(monkeypatch, capsys, *argv)
    except ReachedWork:
        event(f"{argv[0]}: reached the work")
        if argv[0] != "sweep":  # a sweep records its plan first; the others write only once working
            assert files_under(root) == before, (argv, "files written before the work started")
        return "work", capsys.readouterr().err
    finally:
        os.chdir(cwd)
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert files_under(root) == before, (argv, "a refused command left files behind", err)
    event(f"{argv[0]}: " + ("exit 0" if code == 0 else err.split(":")[1].strip()[:30]))
    return ("ok" if code == 0 else "refused"), err


# ---- values -------------------------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10)
NUMBER = st.one_of(st.integers(-10**25, 10**25).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                   st.sampled_from(["0", "1", "1.0", "0.2", "1e-300", "2k", "-1", "16", "512", "9" * 400]))


def value(*choices: str):
    """Mostly the named choices (some valid, some not), else any number or text."""
    named = st.sampled_from(choices)
    return st.integers(0, 4).flatmap(lambda pick: named if pick < 3 else NUMBER if pick == 3 else TEXT)


PATHS = ["{root}/file.txt", "{root}/file.txt/below", "{root}/new/out", "{root}", "/proc/evalkit", "{root}/data.jsonl",
         ""]

RUN_OPTIONS = {
    "--policy": value("h2o_head", "snapkv", "streaming_llm", "full", "quest", "h2o_page", "h2o_haed"),
    "--budget": value("0.2", "1", "64", "1e-300", "0", "1.5"),
    "--task": value("ruler:niah_single_2", "niah", "ppl", "jsonl:{root}/data.jsonl", "jsonl:{root}/nope.jsonl",
                    "{root}/data.jsonl", "hf:nope:test", "ruler:nope"),
    "--task-arg": value("lengths=1k,2k", "depths=0,50", "lengths=" + "9" * 400, "depths=500", "max_new_tokens=4"),
    "--policy-arg": value("window=64", "sink_tokens=4", "window=x", "nope=1", "kernel=5", "sink_tokens",
                          "window=" + "9" * 30, "window=1000000000", "kernel=" + "9" * 400, "sink_tokens=" + "9" * 30,
                          "alpha_safeguard=1e308", "recent=-1e308", "min_pages=" + "9" * 30, "beta=" + "9" * 30),
    "--length": value("300", "2048", "9000", "1000000000"),
    "--samples": value("1", "3", "0"),
    "--format": value("kvpress", "ruler", "auto"),
    "--metric": value("f1", "exact", "string_match_all"),
    "--limit": value("1", "0"),
    "--offset": value("0", "5"),
    "--model": value("smollm2-135m", "{model}", "{root}/no-model", "org/name"),
    "--layout": value("paged", "dense"),
    "--block-size": value("16", "0", "4096"),
    "--granularity": value("head", "token", "page", "head_page", "row"),
    "--prefill": value("full", "chunked"),
    "--sliding-layers": value("budget", "window", "all"),
    "--chunk-size": value("512", "0"),
    "--temperature": value("0", "0.7", "nan", "inf", "-1"),
    "--seed": value("0", "42", "-1", "99999999999999999999999"),
    "--batch-size": value("1", "2", "0"),
    "--pool-pages": value("4", "0"),
    "--dtype": value("auto", "float32", "bfloat16", "int8"),
    "--device": value("auto", "cpu", "cuda", "cuda:1", "tpu9", "meta", "cpu:0"),
    "--out": value(*PATHS),
    "--wandb": value("auto", "off", "offline", "online"),
    "--kernels": value("auto", "torch", "triton", "cuda"),
}
SWEEP_OPTIONS = {
    **{k: v for k, v in RUN_OPTIONS.items() if k not in ("--policy", "--budget", "--task", "--samples")},
    "--policies": value("h2o_head,snapkv", "snapkv", "", ",", "h2o_head,nope"),
    "--budgets": value("0.1,0.5", "1e-300", "0.2,64", ","),
    "--tasks": value("ruler:niah_single_2", "niah,ppl", "jsonl:{root}/data.jsonl"),
    "--length": value("512", "512,1024", "lots", "9000"),
    "--samples": value("1", "2", "0"),
    "--engine": value("local", "ray", "spark"),
    "--config": value("{root}/sweep.yaml", "{root}/sweep.toml", "{root}/sweep.json", "{root}/missing.yaml",
                      "{root}/file.txt"),
}
BENCH_OPTIONS = {
    "--model": RUN_OPTIONS["--model"], "--policies": SWEEP_OPTIONS["--policies"],
    "--policy-arg": RUN_OPTIONS["--policy-arg"], "--budgets": SWEEP_OPTIONS["--budgets"],
    "--lengths": value("1k,2k", "64", "0", "9k", "1k,,2k"), "--layouts": value("paged", "paged,dense", "sparse"),
    "--batch": value("1", "0"), "--new-tokens": value("16", "1"), "--repeats": value("1", "0"),
    "--block-size": value("16", "0"), "--dtype": RUN_OPTIONS["--dtype"], "--device": RUN_OPTIONS["--device"],
    "--seed": RUN_OPTIONS["--seed"], "--threads": value("1", "-1"), "--out": value(*PATHS),
}
MODEL_ARGS = {
    "policy": value("h2o_head", "snapkv", "nope"), "budget": value("0.2", "1e-300", "2.5"),
    "granularity": value("head", "head_page", "row"), "policy_args": value("window:64;kernel:5", "window", "x:1", "window:" + "9" * 30),
    "block_size": value("16", "0"), "layout": value("paged", "sparse"), "batch_size": value("1", "auto"),
    "seed": value("0", "-1"), "device": value("cpu", "cuda:0", "tpu9"), "dtype": value("auto", "int8"),
    "pretrained": value("smollm2-135m", "{model}", "./missing"), "max_length": value("64", "0"),
    "polcy": value("h2o_head"),
}


@st.composite
def options(draw, table: dict, most: int = 5) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(sorted(table)), max_size=most, unique=True))
    argv = []
    for flag in chosen:
        argv += [flag, draw(table[flag])]
    return argv


@st.composite
def model_args(draw) -> list[str]:
    keys = draw(st.lists(st.sampled_from(sorted(MODEL_ARGS)), max_size=4, unique=True))
    pairs = [f"{key}={draw(MODEL_ARGS[key])}" for key in keys]
    return ["--model_args", ",".join(pairs)] if pairs else []


DATA = st.one_of(
    st.binary(max_size=60),
    st.sampled_from([b"\xff\xfe not utf-8\n", b"[1, 2]\n", b'{"context": "c"}\n', b"{}\n{}\n",
                     b'{"context": "c", "question": "q", "answers": ["a"]}\n{"context": "c", "quest',
                     b'{"context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 99999999999999}\n',
                     b'{"input": "x", "outputs": "y"}\n' * 2,
                     # a giant record (2.4 M characters: more than 8192 tokens hold), then a line --limit 1 never reads
                     b'{"context": "' + b"hay " * 600_000 + b'", "question": "q", "answers": ["a"], '
                     b'"max_new_tokens": 4}\n{"context": "c", "quest']))
CONFIG_VALUE = st.one_of(TEXT, NUMBER, st.integers(), st.floats(), st.none(), st.booleans(),
                         st.lists(st.one_of(TEXT, NUMBER), max_size=3),
                         st.dictionaries(TEXT, TEXT, max_size=2))
CONFIG = st.dictionaries(st.sampled_from(["policies", "budgets", "tasks", "length", "samples", "seed", "temperature",
                                          "policy_args", "task_args", "block-size", "device", "granularity", "polices",
                                          "data_sha256", "out"]),
                         CONFIG_VALUE, max_size=4)


def write_inputs(root: Path, data: bytes, config: dict, config_text: str | None) -> None:
    import yaml

    (root / "file.txt").write_text("a regular file where a folder is expected")
    (root / "data.jsonl").write_bytes(data)
    (root / "sweep.json").write_text(config_text if config_text is not None else json.dumps(config))
    (root / "sweep.yaml").write_text(config_text if config_text is not None else yaml.safe_dump(config))
    (root / "sweep.toml").write_text(config_text if config_text is not None else
                                     "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()
                                             if isinstance(v, (str, int, list))))


def fill(argv: list[str], root: Path, model: Path) -> list[str]:
    return [a.replace("{root}", str(root)).replace("{model}", str(model)) for a in argv]


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.model  # fuzzed run, sweep and bench options: without --model, or with smollm2-135m
@pytest.mark.parametrize("command, table", [("run", RUN_OPTIONS), ("sweep", SWEEP_OPTIONS),
                                            ("bench", BENCH_OPTIONS)])
def test_fuzzed_options_are_one_line_or_reach_the_work(guarded, monkeypatch, capsys, command, table):
    extra = ["--dry-run"] if command == "sweep" else []

    @fuzz(EXAMPLES[command])
    @given(argv=options(table), data=DATA, config=CONFIG, config_text=st.one_of(st.none(), TEXT),
           dry=st.booleans())
    def check(argv, data, config, config_text, dry):
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            write_inputs(root, data, config, config_text)
            outcome(monkeypatch, capsys, root, [command, *fill(argv, root, guarded), *(extra if dry else [])])

    check()


def test_fuzzed_lm_eval_arguments_are_one_line_or_reach_lm_eval(guarded, monkeypatch, capsys):
    @fuzz(EXAMPLES["lm-eval"])
    @given(args=model_args(), tasks=st.one_of(st.none(), value("arc_easy", "ek_mc,ek_gen", "")),
           rest=options({"--out": value(*PATHS), "--wandb": value("auto", "off", "online", "bogus")}))
    def check(args, tasks, rest):
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            write_inputs(root, b"", {}, None)
            argv = [*args, *(["--tasks", tasks] if tasks is not None else []), *rest]
            outcome(monkeypatch, capsys, root, ["lm-eval", *fill(argv, root, guarded)])

    check()


RECORD = st.fixed_dictionaries({"id": st.one_of(TEXT, st.integers()), "score": CONFIG_VALUE,
                                "meta": st.one_of(st.fixed_dictionaries({"length": NUMBER, "depth": NUMBER}),
                                                  CONFIG_VALUE)})
STORE_FILE = st.one_of(st.binary(max_size=40), st.sampled_from([b"[]", b"{}", b"\xff\xfe", b'{"config": []}']),
                       st.dictionaries(st.sampled_from(["score", "samples", "bytes_held", "held_over_full",
                                                        "prompt_tokens", "budget", "policy", "config"]),
                                       CONFIG_VALUE, max_size=4).map(lambda d: json.dumps(d).encode()))
PREDICTIONS = st.one_of(st.binary(max_size=60),
                        st.lists(RECORD, max_size=3).map(lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode()),
                        st.sampled_from([b'{"id": 1, "score": 1, "meta": {"length": 512, "depth": 50}}\n{"id": 2, "sc',
                                         b"\xff\n"]))


def write_store(root: Path, metrics: bytes, config: bytes, predictions: bytes) -> Path:
    """runs/: one good niah run and one run of the fuzzed files."""
    good = root / "runs" / "good"
    good.mkdir(parents=True)
    (good / "config.json").write_text(json.dumps({"config": {"policy": "full", "budget": 1.0, "task": "niah",
                                                             "length": 512}}))
    (good / "metrics.json").write_text(json.dumps({"score": 1.0, "samples": 1, "held_over_full": 1.0,
                                                   "bytes_held": 10.0, "prompt_tokens": 100}))
    (good / "predictions.jsonl").write_text(json.dumps({"id": "a", "score": 1.0,
                                                        "meta": {"length": 512, "depth": 50.0}}) + "\n")
    fuzzed = root / "runs" / "fuzzed"
    fuzzed.mkdir()
    (fuzzed / "metrics.json").write_bytes(metrics)
    (fuzzed / "config.json").write_bytes(config)
    (fuzzed / "predictions.jsonl").write_bytes(predictions)
    return fuzzed


@pytest.mark.parametrize("command", [
    pytest.param("report", marks=pytest.mark.slow),  # hundreds of fuzzed run folders, each read by a report
    "heatmap",
])
def test_fuzzed_store_files_are_skipped_or_refused_in_one_line(guarded, monkeypatch, capsys, command):
    @fuzz(EXAMPLES[command])
    @given(metrics=STORE_FILE, config=STORE_FILE, predictions=PREDICTIONS,
           out=st.sampled_from(["{root}/made", "{root}/runs", "{root}/file.txt", "{root}/made/x.png"]))
    def check(metrics, config, predictions, out):
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            write_inputs(root, b"", {}, None)
            fuzzed = write_store(root, metrics, config, predictions)
            target = out.replace("{root}", str(root))
            argv = (["report", str(root / "runs"), "-o", target] if command == "report" else
                    ["heatmap", str(root / "runs" / "good"), str(fuzzed), "-o", target])
            result, err = outcome(monkeypatch, capsys, root, argv)
            if result == "refused" and command == "report" and "file.txt" not in target:
                assert "fuzzed" in err or "no complete runs" in err, err

    check()

