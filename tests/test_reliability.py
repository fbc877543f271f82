"""Nothing finished is ever lost (issue #15): W&B can never cost a result, run folders are locked and
resume without duplicates, and the inputs that once ended in a traceback are one line and exit 2 before
any model loads."""

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import needs_model_files
from evalkit.errors import EvalkitError
from helpers import evalkit

EVALKIT = str(Path(sys.executable).parent / "evalkit")
RECORDS = [{"id": f"r{i}", "context": f"The code is {i}{i}{i}. " * 20, "question": "What is the code?",
            "answers": [f"{i}{i}{i}"], "max_new_tokens": 4} for i in range(3)]


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with the default model's tokenizer: a real run in a second or two."""
    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    (folder / "data.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return folder


@pytest.fixture
def no_wandb_credentials(monkeypatch, tmp_path):
    """W&B as on a fresh machine: no key, no netrc, WANDB_MODE unset; any endpoint a closed local port."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    port = closed_port()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_args(model: Path, out: Path, *extra: str) -> list[str]:
    """A run of three short records (four new tokens each) on the tiny model: seconds, not minutes."""
    return ["run", "--model", str(model), "--task", f"jsonl:{model / 'data.jsonl'}", "--length", "300",
            "--policy", "h2o_head", "--budget", "0.5", "--out", str(out), "--no-baseline", *extra]


def the_run(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return folder


def lines(folder: Path) -> list[str]:
    return (folder / "predictions.jsonl").read_text().splitlines()


# ---- W&B can never cost a result ------------------------------------------------------------------------

@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_wandb_with_a_key_and_no_route_costs_seconds_not_the_result(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                     no_wandb_credentials):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # credentials W&B would use, if anything answered
    started = time.monotonic()
    code, _, _ = evalkit(monkeypatch, capsys, *run_args(tiny_model_dir, tmp_path / "off", "--wandb", "off"))
    off_seconds = time.monotonic() - started
    assert code == 0

    started = time.monotonic()
    code, _, err = evalkit(monkeypatch, capsys, *run_args(tiny_model_dir, tmp_path / "auto"))  # --wandb auto
    auto_seconds = time.monotonic() - started
    assert code == 0, err
    notes = [line for line in err.splitlines() if "W&B" in line]
    assert notes == [f"note: W&B at {no_wandb_credentials} is not reachable (Connection refused): logging offline; "
                     "`wandb sync` uploads it later"]
    folder = the_run(tmp_path / "auto")
    assert json.loads((folder / "metrics.json").read_text())["samples"] == 3 and len(lines(folder)) == 3
    assert list((folder / "wandb").glob("offline-run-*"))  # mirrored offline instead
    assert auto_seconds < off_seconds + 10, (auto_seconds, off_seconds)

    # Asked for explicitly, online without a route is refused before any work.
    code, _, err = evalkit(monkeypatch, capsys, *run_args(tiny_model_dir, tmp_path / "online", "--wandb", "online"))
    assert code == 2 and "--wandb online: W&B at" in err and "is not reachable" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "online").exists()


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_wandb_online_without_credentials_is_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                      no_wandb_credentials):
    for command in (run_args(tiny_model_dir, tmp_path / "runs", "--wandb", "online"),
                    ["sweep", "--model", str(tiny_model_dir), "--policies", "h2o_head", "--budgets", "0.5",
                     "--tasks", f"jsonl:{tiny_model_dir / 'data.jsonl'}", "--length", "300",
                     "--out", str(tmp_path / "runs"), "--wandb", "online"],
                    ["lm-eval", "--tasks", "anything", "--out", str(tmp_path / "runs"), "--wandb", "online"]):
        code, _, err = evalkit(monkeypatch, capsys, *command)
        assert code == 2 and err.strip().splitlines() == [
            "error: --wandb online needs W&B credentials: set WANDB_API_KEY or run `wandb login` (or log with "
            "--wandb offline and `wandb sync` later)"], command
        assert not (tmp_path / "runs").exists()


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_wandb_failing_after_the_run_is_one_warning_and_exit_0(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                no_wandb_credentials):
    from evalkit.integrations import wandb as tracking

    def crash(*_, **__):
        raise RuntimeError("wandb-core exited\nwith a long story")

    monkeypatch.setattr(tracking, "_log_run", crash)
    code, _, err = evalkit(monkeypatch, capsys, *run_args(tiny_model_dir, tmp_path / "runs", "--wandb", "offline"))
    assert code == 0
    folder = the_run(tmp_path / "runs")
    assert err.strip().splitlines() == [f"warning: W&B logging of run {folder.name} failed, the results on disk are "
                                        "complete: RuntimeError: wandb-core exited"]
    assert (folder / "metrics.json").exists()


@pytest.mark.model  # runs the default model
def test_the_runner_mirrors_to_wandb_only_through_the_mirror_its_caller_hands_in(tmp_path):
    """The core imports no tool: `evalkit run` hands `evalkit.integrations.wandb` to the runner. Called
    without it, a W&B mode that asks for logging is refused before any work, not silently dropped."""
    from evalkit.config import RunConfig
    from evalkit.runner import run

    config = RunConfig(out=str(tmp_path), wandb="offline")
    with pytest.raises(EvalkitError, match="needs a mirror"):
        run(config)
    assert not (tmp_path / config.run_id()).exists()


def test_wandb_mode_is_decided_up_front_within_the_timeout(monkeypatch, no_wandb_credentials):
    import http.server

    from evalkit.integrations import wandb as tracking

    said = []
    assert tracking.decide_wandb_mode("auto", said.append) == "offline" and said == []  # no credentials: quietly
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    # A server that never answers (or a name that never resolves): given up on after the timeout.
    monkeypatch.setattr(tracking, "REACH_TIMEOUT_S", 0.5)
    def silent(*_, **__):
        time.sleep(5)
        raise TimeoutError("timed out")

    monkeypatch.setattr(tracking.urllib.request, "urlopen", silent)
    started = time.monotonic()
    assert tracking.decide_wandb_mode("auto", said.append) == "offline"
    assert time.monotonic() - started < 2
    assert said == [f"W&B at {no_wandb_credentials} is not reachable (no answer within 0.5 s): logging offline; "
                    "`wandb sync` uploads it later"]
    with pytest.raises(EvalkitError, match=r"not reachable \(no answer within 0.5 s\)"):
        tracking.decide_wandb_mode("online", said.append)
    monkeypatch.undo()

    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
        assert tracking.decide_wandb_mode("auto", said.append) == "online"
    finally:
        server.shutdown()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.decide_wandb_mode("online", said.append) == "off" and len(said) == 1


def test_lm_eval_results_are_on_disk_before_wandb_is_told(tmp_path, monkeypatch):
    from evalkit.integrations import wandb as tracking
    from evalkit.integrations.lm_eval_command import save_run

    seen = []

    def unreachable(mode, run_dir, *_):
        seen.append((run_dir / "metrics.json").exists())
        raise ConnectionError("no route to host")

    monkeypatch.setattr(tracking, "_log_run", unreachable)
    results = {"config": {"evalkit": {"args": {"policy": "h2o_head", "budget": 0.2, "policy_args": {}},
                                      "policy": "H2O()", "summary": {"requests": 1},
                                      "predictions": [{"id": "a", "type": "loglikelihood"}]}},
               "configs": {"t": {}}, "results": {"t": {"alias": "t", "acc,none": 0.5}}}
    warnings = []
    folder = save_run(results, tmp_path, "offline", warnings.append)
    assert seen == [True]
    assert json.loads((folder / "metrics.json").read_text())["t/acc,none"] == 0.5
    assert warnings == [f"W&B logging of run {folder.name} failed, the results on disk are complete: "
                        "ConnectionError: no route to host"]
    # Without hyper-parameters the run id is what it was before policy_args existed.
    with_args = {**results, "config": {"evalkit": {**results["config"]["evalkit"],
                                                   "args": {"policy": "h2o_head", "budget": 0.2,
                                                            "policy_args": {"sink_tokens": "4"}}}}}
    assert save_run(with_args, tmp_path, "off").name != folder.name


def test_policy_args_enter_the_run_id_only_when_given():
    from evalkit.config import RunConfig

    plain = RunConfig()
    assert "policy_args" not in plain.identity()
    tuned = RunConfig(policy="snapkv", policy_args={"window": "32"})
    assert tuned.identity()["policy_args"] == {"window": "32"}
    assert tuned.run_id() != RunConfig(policy="snapkv").run_id()


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_policy_args_reach_the_policy_in_run_sweep_and_lm_eval(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from conftest import tiny_model
    from evalkit.config import RunConfig
    from evalkit.integrations.lm_eval import EvalkitLM

    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, *run_args(tiny_model_dir, out, "--wandb", "off", "--policy", "snapkv",
                                                          "--policy-arg", "window=8", "--policy-arg", "kernel=3"))
    assert code == 0, err
    stored = json.loads((the_run(out) / "config.json").read_text())
    assert stored["config"]["policy_args"] == {"window": "8", "kernel": "3"}
    assert "observation_window=8" in stored["policy"] and "kernel_size=3" in stored["policy"]

    (tmp_path / "sweep.yaml").write_text("policy_args:\n  window: 8\n")
    grid = ["sweep", "--policies", "snapkv", "--budgets", "0.5", "--length", "512", "--samples", "1",
            "--out", str(out), "--dry-run"]
    plans = [evalkit(monkeypatch, capsys, *grid, *extra)[1] for extra in (["--policy-arg", "window=8"],
                                                                          ["--config", str(tmp_path / "sweep.yaml")])]
    assert plans[0] == plans[1]
    cell = RunConfig(policy="snapkv", budget=0.5, length=512, samples=1, policy_args={"window": "8"})
    baseline = RunConfig(policy="full", budget=1.0, length=512, samples=1)  # the full cache, without them
    assert cell.validate().run_id() in plans[0] and baseline.validate().run_id() in plans[0]

    lm = EvalkitLM(pretrained=tiny_model(), tokenizer=object(), policy="snapkv", policy_args="window:8;kernel:3")
    assert (lm.policy.observation_window, lm.policy.kernel_size) == (8, 3)


# ---- locked run folders --------------------------------------------------------------------------------

class Reader:
    """A subprocess's stderr, read as it comes."""

    def __init__(self, process: subprocess.Popen):
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for line in stream:
            self.text += line


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_concurrent_identical_runs_write_each_sample_once(tiny_model_dir, tmp_path):
    from evalkit.config import RunConfig
    from evalkit.results import RunDir

    out = tmp_path / "runs"
    config = RunConfig(model=str(tiny_model_dir), task=f"jsonl:{tiny_model_dir / 'data.jsonl'}", length=300,
                       policy="h2o_head", budget=0.5, out=str(out))
    run_dir = RunDir(out, config.validate().run_id())
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    command = [EVALKIT, *run_args(tiny_model_dir, out, "--wandb", "off")]
    with run_dir.locked():  # held here until both processes wait for it: then they really race for it
        processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for _ in range(2)]
        readers = [Reader(p) for p in processes]
        deadline = time.monotonic() + 600
        while not all("waiting for another evalkit process" in r.text for r in readers):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), [r.text for r in readers]
            time.sleep(0.2)
        assert not run_dir.predictions_path.exists()
    stdouts = [p.communicate(timeout=600)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [r.text for r in readers]
    records = [json.loads(line) for line in lines(run_dir.path)]
    assert len(records) == 3 and len({r["id"] for r in records}) == 3
    assert sum("already complete" in s for s in stdouts) == 1  # the second found the first's finished run
    assert json.loads(run_dir.metrics_path.read_text())["samples"] == 3
    assert not run_dir.lock_path.exists()


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_a_sweep_runs_the_cells_no_other_process_holds_first(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Two sweeps sharing a cell (the same full cache, say): the second runs its other cells instead of idling."""
    from evalkit.config import RunConfig
    from evalkit.results import RunDir

    out, data = tmp_path / "runs", f"jsonl:{tiny_model_dir / 'data.jsonl'}"
    held, free = (RunDir(out, RunConfig(model=str(tiny_model_dir), task=data, length=length, out=str(out))
                         .full_cache().validate().run_id()) for length in (300, 250))
    free_done_first, locked = [], threading.Event()

    def other_process():  # holds the first group's full cache until the second's is complete (at most a minute)
        with held.locked():
            locked.set()
            deadline = time.monotonic() + 60
            while not free.complete and time.monotonic() < deadline:
                time.sleep(0.1)
            free_done_first.append(free.complete and not held.predictions_path.exists())

    holder = threading.Thread(target=other_process)
    holder.start()
    assert locked.wait(60)
    code, _, err = evalkit(monkeypatch, capsys, "sweep", "--model", str(tiny_model_dir), "--tasks", data,
                           "--length", "300,250", "--policies", "h2o_head", "--budgets", "0.5", "--out", str(out),
                           "--wandb", "off")
    holder.join()
    assert code == 0 and free_done_first == [True], err
    assert held.complete and free.complete  # the held group ran once the other process let it go
    assert err.count("another evalkit process holds a folder of") == 1, err


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_resume_drops_repeated_lines_and_says_so(tiny_model_dir, tmp_path, monkeypatch, capsys):
    args = run_args(tiny_model_dir, tmp_path / "runs", "--wandb", "off")
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    folder = the_run(tmp_path / "runs")
    first, metrics = lines(folder), json.loads((folder / "metrics.json").read_text())
    # What two unlocked writers could leave: a line twice, then a torn one, and no metrics.json.
    (folder / "predictions.jsonl").write_text(first[0] + "\n" + first[0] + "\n" + first[1] + "\n" + first[2][:30])
    (folder / "metrics.json").unlink()
    code, out, err = evalkit(monkeypatch, capsys, *args)
    assert code == 0 and "resumed after 2 samples" in out
    assert f"note: {folder / 'predictions.jsonl'} held 1 repeated sample lines" in err.replace("\n", " ")
    assert [json.loads(line)["id"] for line in lines(folder)] == [json.loads(line)["id"] for line in first]
    resumed = json.loads((folder / "metrics.json").read_text())
    assert {k: resumed[k] for k in ("samples", "score", "kept_tokens")} == \
        {k: metrics[k] for k in ("samples", "score", "kept_tokens")}


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_a_run_resumed_on_another_machine_says_from_which_sample(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import torch

    args = run_args(tiny_model_dir, tmp_path / "runs", "--wandb", "off")
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    folder = the_run(tmp_path / "runs")
    here = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_instructions": None,
            "threads": torch.get_num_threads(), "device": "cpu"}
    stored = json.loads((folder / "config.json").read_text())
    assert stored["machine"] == here and "later_machines" not in stored

    def interrupt_after(samples: int, machine: dict | None) -> None:
        (folder / "metrics.json").unlink()
        (folder / "predictions.jsonl").write_text("".join(line + "\n" for line in lines(folder)[:samples]))
        config = json.loads((folder / "config.json").read_text())
        if machine is not None:
            config["machine"] = machine
        (folder / "config.json").write_text(json.dumps(config))

    interrupt_after(1, {**here, "cpu_capability": "AVX2"})  # its first sample came from another CPU
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    stored = json.loads((folder / "config.json").read_text())
    assert stored["machine"]["cpu_capability"] == "AVX2"
    assert [(entry["from_sample"], entry["machine"]) for entry in stored["later_machines"]] == [(1, here)]

    interrupt_after(2, None)  # resumed on the machine that computed its last samples: nothing to add
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    assert json.loads((folder / "config.json").read_text())["later_machines"] == stored["later_machines"]

    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # the same CPU told to take other kernels
    interrupt_after(2, None)
    assert evalkit(monkeypatch, capsys, *args)[0] == 0
    later = json.loads((folder / "config.json").read_text())["later_machines"]
    assert [(entry["from_sample"], entry["machine"]) for entry in later] == \
        [(1, here), (2, {**here, "mkl_instructions": "AVX2"})]


# ---- one line, exit 2, before any model loads -------------------------------------------------------------

NINES = "9" * 400
# The cases marked `model` need the default model's config.json: those that name its window ("has 8192"), every
# sweep (it resolves the default model before it checks its cells), and run's and bench's --out (checked after
# the window).
BAD_INPUT = [
    (["run", "--device", "tpu9"], "unknown device 'tpu9'; choose from auto, cpu, cuda, cuda:N"),
    (["run", "--device", "cuda:x"], "unknown device 'cuda:x'"),
    (["run", "--device", "meta"], "device 'meta' is not supported"),
    pytest.param(["run", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
    (["run", "--seed", "99999999999999999999999"], "seed must be in [0, 2**32), got 99999999999999999999999"),
    (["run", "--seed", "-1"], "seed must be in [0, 2**32)"),
    (["run", "--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["run", "--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["run", "--temperature", "-0.5"], "temperature must be a finite number >= 0"),
    (["run", "--task", "niah", "--task-arg", f"lengths={NINES}"], "is beyond any model's window"),
    pytest.param(["run", "--task", "niah", "--task-arg", "lengths=100k"],
                 "smollm2-135m has 8192: lower the task's lengths", marks=pytest.mark.model),
    pytest.param(["run", "--length", "1000000000"], "smollm2-135m has 8192: lower --length", marks=pytest.mark.model),
    pytest.param(["run", "--length", "1000000"], "smollm2-135m has 8192: lower --length", marks=pytest.mark.model),
    pytest.param(["run", "--task", "ppl", "--length", "100000"], "smollm2-135m has 8192: lower --length",
                 marks=pytest.mark.model),
    (["run", "--length", "9" * 30], "is more than any model's window"),
    (["run", "--budget", "1e-300"], "budget 1e-300 keeps less than one token of --length 2048: the smallest "
                                    "useful fraction is 0.000489"),
    (["run", "--budget", "9" * 30], "is more than any model's window"),
    (["run", "--block-size", "9" * 20], "block-size 99999999999999999999 is more than any model's window"),
    (["run", "--policy", "h2o_page", "--budget", "0.001"], "less than one page"),
    (["run", "--policy-arg", "window"], "policy-arg must be KEY=VALUE, got 'window'"),
    (["run", "--policy", "snapkv", "--policy-arg", "window=lots"], "window"),
    (["run", "--policy", "h2o_head", "--policy-arg", "nope=1"], "has no policy-arg 'nope'"),
    pytest.param(["run", "--out", "{file}"], "--out {file} is a file, not a folder", marks=pytest.mark.model),
    pytest.param(["run", "--out", "{file}/runs"], "is inside {file}, which is a file", marks=pytest.mark.model),
    pytest.param(["run", "--out", ""], "--out is empty: give a folder, such as runs",
                 marks=pytest.mark.model),  # was: run folders in the current one
    # Bounds declared where each option or policy field is declared (RunConfig's `setting`, policies' `arg`).
    (["run", "--samples", "1" + "0" * 30, "--length", "512"], "is more than one run takes (the limit is 1,000,000)"),
    (["run", "--batch-size", "9" * 30], "batch-size 999999999999999999999999999999 is more than one run takes"),
    (["run", "--chunk-size", "0"], "chunk-size must be >= 1, got 0"),
    (["run", "--pool-pages", "9" * 30], "pool-pages 999999999999999999999999999999 is more than any model's"),
    (["run", "--policy", "snapkv", "--policy-arg", "window=1000000000"],
     "snapkv_head: policy-arg window 1000000000 is more than --length 2048: it must be in [1, 2048]"),
    (["run", "--policy", "snapkv", "--policy-arg", f"window={'9' * 30}"], "policy-arg window must be in [1, --length]"),
    (["run", "--policy", "snapkv", "--policy-arg", "kernel=4097"], "policy-arg kernel 4097 is more than --length"),
    (["run", "--policy", "adakv", "--policy-arg", "alpha_safeguard=2"], "alpha_safeguard must be in [0.0, 1.0]"),
    (["run", "--policy", "quest", "--policy-arg", "min_pages=0"], "min_pages must be in [1, 2147483647]"),
    pytest.param(["sweep", "--samples", "1" + "0" * 30, "--dry-run"], "is more than one run takes",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--policies", "snapkv", "--policy-arg", f"window={'9' * 30}", "--dry-run"],
                 "policy-arg window must be", marks=pytest.mark.model),
    pytest.param(["sweep", "--temperature", "nan", "--dry-run"], "temperature must be a finite number >= 0, got nan",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--seed", "99999999999999999999999", "--dry-run"], "seed must be in [0, 2**32)",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--budgets", "0.1,1e-300", "--dry-run"], "the smallest useful fraction is",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--policies", "snapkv", "--policy-arg", "window=x", "--dry-run"], "window",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--policies", "snapkv", "--config", "{tmp}/args.yaml", "--dry-run"], "window",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--device", "tpu9", "--dry-run"], "unknown device 'tpu9'", marks=pytest.mark.model),
    pytest.param(["sweep", "--out", "{file}"], "--out {file} is a file, not a folder", marks=pytest.mark.model),
    pytest.param(["sweep", "--out", ""], "--out is empty: give a folder", marks=pytest.mark.model),
    (["bench", "--device", "tpu9"], "unknown device 'tpu9'"),
    (["bench", "--seed", "-1"], "seed must be in [0, 2**32)"),
    (["bench", "--policies", "snapkv", "--policy-arg", "nope=1"], "has no policy-arg 'nope'"),
    pytest.param(["bench", "--out", "{file}"], "--out {file} is a file, not a folder", marks=pytest.mark.model),
    pytest.param(["bench", "--out", ""], "--out is empty: give a folder", marks=pytest.mark.model),
    (["lm-eval"], "lm-eval needs --tasks NAME[,NAME...]"),
    (["lm-eval", "--tasks"], "expected at least one argument"),
    (["lm-eval", "--tasks", "x", "--out", "{file}"], "--out {file} is a file, not a folder"),
    (["lm-eval", "--tasks", "x", "--out", ""], "--out is empty: give a folder"),
    (["lm-eval", "--tasks", "x", "--wandb", "sometimes"], "unknown wandb 'sometimes'"),
    (["lm-eval", "--tasks", "x", "--model_args", "seed=-1"], "seed must be an integer in [0, 2**32)"),
    (["lm-eval", "--tasks", "x", "--model_args", "device=tpu9"], "unknown device 'tpu9'"),
    (["lm-eval", "--tasks", "x", "--model_args", "policy=snapkv,policy_args=window"],
     "policy_args must be KEY:VALUE pairs separated by ';'"),
    (["lm-eval", "--tasks", "x", "--model_args", "policy=snapkv,policy_args=window:x"], "window"),
    (["heatmap", "{tmp}/niah-run", "-o", "{tmp}"], "-o {tmp} is a folder: give a file name"),
    (["heatmap", "{tmp}/niah-run", "-o", "{file}/x.png"], "which is a file"),
    (["report", "{tmp}/runs", "-o", "{file}"], "-o {file} is a file, not a folder"),
    (["report", "{tmp}/runs", "-o", ""], "-o is empty: give a folder"),  # was: the report in the current folder
    (["run", "--task", "hf:a:b:c:d"], "hf:a:b:c:d"),  # user text printed as given: `:b:` is no emoji code
    # Issue #53's probe: what still slipped through.
    (["run", "--task", "jsonl:{tmp}/a\nb.jsonl"], "no data file '{tmp}/a\\nb.jsonl'"),  # one line still
    (["run", "--policy", "expected_attention_head", "--policy-arg", "n_sink=4", "--policy-arg", "sink_tokens=8"],
     "expected_attention_head: policy-args n_sink and sink_tokens both set sink_tokens (one is the other's alias)"),
    (["run", "--policy", "expected_attention_head", "--policy-arg", "n_future=4", "--policy-arg", "n_future=8"],
     "policy-arg n_future is given twice (4 and 8): give it once"),
    (["run", "--policy", "expected_attention_head", "--policy-arg", "n_future_positions=0"],
     "policy-arg n_future_positions must be in [1, "),  # the name typed, not the field's
    (["run", "--policy", "kvzip", "--policy-arg", "chunk_size=0"], "policy-arg chunk_size must be in [1, "),
    pytest.param(["run", "--policy", "duo_attention", "--policy-arg", "sink_size=100000000"],
                 "nothing to evict; lower policy-arg sink_size / recent_size: the model has 8192 positions",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--config", "{tmp}/bomb.yaml", "--dry-run"],
                 "bomb.yaml: YAML alias *a on line 2: a config takes no aliases; write the values out",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--config", "{tmp}/twice.yaml", "--dry-run"], "twice.yaml: key 'policies' is given twice",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--config", "{tmp}/twice.json", "--dry-run"], "twice.json: key 'samples' is given twice",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--config", "{tmp}/latin1.yaml", "--dry-run"],
                 "latin1.yaml is not UTF-8 text (byte 0xe9 at offset 32)", marks=pytest.mark.model),
    pytest.param(["sweep", "--config", "{tmp}/noise.toml", "--dry-run"],
                 "noise.toml is not UTF-8 text (byte 0x80 at offset 0)", marks=pytest.mark.model),
    pytest.param(["sweep", "--policies", ",".join(["h2o_head", "snapkv", "tova", "knorm", "keydiff", "lagkv", "kvzip",
                                                   "random", "streaming_llm", "expected_attention"]),
                  "--budgets", ",".join(str(i / 1000) for i in range(1, 501)),
                  "--length", ",".join(str(600 + i) for i in range(100)), "--dry-run"],
                 "the grid has 500,100 cells (with each task and length's full cache), more than 10,000",
                 marks=pytest.mark.model),
    pytest.param(["sweep", "--policies", "snapkv,,h2o_head", "--dry-run"], "--policies has an empty item",
                 marks=pytest.mark.model),
]


@pytest.fixture
def refuse_models(monkeypatch):
    from transformers import AutoModelForCausalLM

    from evalkit import models, runner

    def loaded(*_, **__):
        raise AssertionError("a model was loaded")

    for owner, name in ((models, "load_model"), (runner, "load_model"), (AutoModelForCausalLM, "from_pretrained")):
        monkeypatch.setattr(owner, name, loaded)


def niah_store(root: Path) -> Path:
    """runs/niah-run: a complete niah run of one prediction, as the heatmap and report read it."""
    folder = root / "runs" / "niah-run"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": {"policy": "full", "budget": 1.0, "task": "niah",
                                                               "length": 512}}))
    (folder / "metrics.json").write_text(json.dumps({"score": 1.0, "samples": 1}))
    (folder / "predictions.jsonl").write_text(json.dumps({"id": "a", "score": 1.0,
                                                          "meta": {"length": 512, "depth": 50.0}}) + "\n")
    return folder


@pytest.mark.parametrize("argv, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(refuse_models, no_wandb_credentials, monkeypatch,
                                                                  capsys, tmp_path, argv, message):
    (tmp_path / "file.txt").write_text("a regular file where a folder is expected")
    (tmp_path / "args.yaml").write_text("policy_args:\n  window: x\n")
    # 347 bytes that expanded to 21 GB: nine of nine of ... eight levels of aliases
    (tmp_path / "bomb.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{name}: &{name} [{', '.join([f'*{alias}'] * 9)}]\n" for alias, name in zip("abcdefg", "bcdefgh")) +
        "policies: [*h, *h, *h, *h, *h, *h, *h, *h, *h]\n")
    (tmp_path / "twice.yaml").write_text("policies: [h2o_head]\nbudgets: [0.2]\npolicies: [snapkv]\n")
    (tmp_path / "twice.json").write_text('{"samples": 3, "samples": 4}')
    (tmp_path / "latin1.yaml").write_bytes("policies: [h2o_head]\ntasks: [café]\n".encode("latin-1"))
    (tmp_path / "noise.toml").write_bytes(bytes(range(128, 256)))
    (tmp_path / "niah-run").mkdir()
    (tmp_path / "niah-run" / "config.json").write_text(json.dumps({"config": {"policy": "full", "budget": 1.0}}))
    (tmp_path / "niah-run" / "predictions.jsonl").write_text(
        json.dumps({"id": "a", "score": 1.0, "meta": {"length": 512, "depth": 50.0}}) + "\n")
    niah_store(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))

    def fill(text: str) -> str:
        return text.replace("{file}", str(tmp_path / "file.txt")).replace("{tmp}", str(tmp_path))

    argv = [fill(a) for a in argv]
    if argv[0] in ("run", "sweep", "bench") and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    code, _, err = evalkit(monkeypatch, capsys, *argv)
    assert code == 2 and fill(message) in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written, nothing left behind


@pytest.mark.slow  # lm-eval builds its index of every task it knows (4-5 s) to say one is unknown
def test_unknown_lm_eval_tasks_are_refused_before_the_model_loads(refuse_models, monkeypatch, capsys, tmp_path):
    code, _, err = evalkit(monkeypatch, capsys, "lm-eval", "--tasks", "no_such_task_xyz", "--out", str(tmp_path))
    assert code == 2 and err.strip() == "error: lm-eval: Tasks not found: no_such_task_xyz"


# ---- issue #34: giant records, missing optional packages, a full disk ---------------------------------------

@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_a_giant_data_record_is_refused_in_seconds_naming_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """One 50 MB record: refused before the tokenizer sees it (it took minutes), no run folder left."""
    data = tmp_path / "giant.jsonl"
    data.write_text(json.dumps(dict(RECORDS[0], id="giant", context="hay " * 12_500_000)) + "\n")
    out = tmp_path / "runs"
    started = time.monotonic()
    code, _, err = evalkit(monkeypatch, capsys, "run", "--model", str(tiny_model_dir), "--task", f"jsonl:{data}",
                           "--length", "300", "--policy", "h2o_head", "--budget", "0.5", "--out", str(out),
                           "--no-baseline", "--wandb", "off")
    assert time.monotonic() - started < 10
    assert code == 2 and err.startswith(f"error: {data}: record 1 (id 'giant') has 50,000,0") and \
        "more than --length 300 tokens hold" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
@pytest.mark.parametrize("missing, address, message", [
    ("grpc", "ray://127.0.0.1:10001", "error: the Ray address ray://127.0.0.1:10001 is reached through Ray Client, "
                                      "which needs the package grpcio (Ray's client extra): pip install grpcio"),
    ("ray", None, "error: --engine ray needs the package ray: pip install ray"),
])
def test_a_missing_optional_package_is_one_line_naming_it(tiny_model_dir, refuse_models, tmp_path, monkeypatch,
                                                           capsys, missing, address, message):
    """Ray Client without ray[client] was a ValueError traceback, after the sweep had written its plan."""
    monkeypatch.setitem(sys.modules, missing, None)  # `import` of it fails, as when it is not installed
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, "sweep", "--model", str(tiny_model_dir), "--policies", "h2o_head",
                           "--budgets", "0.5", "--tasks", f"jsonl:{tiny_model_dir / 'data.jsonl'}", "--length", "300",
                           "--out", str(out), "--wandb", "off", "--engine", "ray",
                           *(["--ray-address", address] if address else []))
    assert code == 2 and err.strip().splitlines() == [message], err
    assert not out.exists()


def full_disk(monkeypatch, name: str, good_writes: int) -> None:
    """The results store on a disk that fills up: after `good_writes` writes to files called `name`, the next
    one gets half its text in, then ENOSPC (as a write to a full disk)."""
    from evalkit import results

    real_open, writes = open, []

    class Filling:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            writes.append(len(text))
            if len(writes) <= good_writes:
                return self.file.write(text)
            self.file.write(text[:len(text) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, attribute):
            return getattr(self.file, attribute)

        def __enter__(self):
            return self

        def __exit__(self, *_):
            self.file.close()

    def filling_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return Filling(file) if Path(path).name == name and "r" not in mode else file

    monkeypatch.setattr(results, "open", filling_open, raising=False)


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
@pytest.mark.parametrize("name, good_writes, recorded", [
    ("config.json.tmp", 0, None),  # the first finished sample's config.json: no run folder stays
    ("predictions.jsonl", 1, 1),  # the second sample's line: half of it got in
    ("metrics.json.tmp", 0, 3),  # every sample recorded, the run not marked complete
])
def test_a_full_disk_is_one_line_and_exit_1_and_the_run_resumes(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                 name, good_writes, recorded):
    from evalkit.config import RunConfig

    out = tmp_path / "runs"
    folder = out / RunConfig(model=str(tiny_model_dir), task=f"jsonl:{tiny_model_dir / 'data.jsonl'}", length=300,
                             policy="h2o_head", budget=0.5, out=str(out)).validate().run_id()
    args = run_args(tiny_model_dir, out, "--wandb", "off")
    with monkeypatch.context() as patched:
        full_disk(patched, name, good_writes)
        code, _, err = evalkit(monkeypatch, capsys, *args)
    target = name.removesuffix(".tmp")
    (line,) = err.splitlines()  # one line: no blank one left by the progress bar before it
    assert code == 1 and line.startswith(f"error: no space left on the device of {folder}: writing {target} (") \
        and line.endswith(" bytes) failed; free some space and run the same command again, it resumes"), err
    assert not list(tmp_path.rglob("*.tmp"))
    if recorded is None:
        assert not out.exists()
    else:  # whole lines only: half a line is no sample
        assert [json.loads(line)["id"] for line in lines(folder)] == [r["id"] for r in RECORDS[:recorded]]
        assert (folder / "predictions.jsonl").read_text().endswith("\n") and not (folder / "metrics.json").exists()

    code, stdout, err = evalkit(monkeypatch, capsys, *args)  # space again: the same command resumes
    assert code == 0, err
    if recorded:
        assert f"resumed after {recorded} samples" in stdout
    assert [json.loads(line)["id"] for line in lines(folder)] == [r["id"] for r in RECORDS]
    assert json.loads((folder / "metrics.json").read_text())["samples"] == 3


def test_heatmap_names_the_incomplete_runs_in_one_line_and_still_draws(monkeypatch, capsys, tmp_path):
    complete = niah_store(tmp_path)
    cut, unfinished = complete.with_name("cut-short"), complete.with_name("unfinished")
    for folder, metrics in ((cut, {"score": 1.0, "samples": 3}), (unfinished, None)):
        folder.mkdir()
        for name in ("config.json", "predictions.jsonl"):
            (folder / name).write_bytes((complete / name).read_bytes())
        if metrics:
            (folder / "metrics.json").write_text(json.dumps(metrics))
    code, out, err = evalkit(monkeypatch, capsys, "heatmap", str(complete), str(cut), str(unfinished),
                             "-o", str(tmp_path / "h.png"))
    assert code == 0 and (tmp_path / "h.png").stat().st_size > 0
    assert err.strip().splitlines() == [f"note: incomplete runs, drawn with the cells they have: {cut} (1 of 3 "
                                        f"predictions), {unfinished} (1 predictions, not finished)"]


# ---- store files: skipped or refused in one line, never a partial output -------------------------------------

def test_report_skips_malformed_store_files_naming_them(monkeypatch, capsys, tmp_path):
    runs = niah_store(tmp_path).parent
    for name, metrics, predictions in (("a-list", b"[1, 2]", b""), ("not-utf8", b'{"score": 0.5}', b"\xff\xfe\n"),
                                       ("huge", b'{"score": 0.5, "bytes_held": 1e999}', b"")):
        folder = runs / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"config": {"policy": "h2o_head", "budget": 0.5}}))
        (folder / "metrics.json").write_bytes(metrics)
        (folder / "predictions.jsonl").write_bytes(predictions)
    code, out, err = evalkit(monkeypatch, capsys, "report", str(runs), "-o", str(tmp_path / "report"))
    assert code == 0 and err == ""
    left_out = [line for line in out.splitlines() if line.startswith("left out:")]
    assert len(left_out) == 3 and "2 runs" in out
    assert any(f"{runs / 'a-list' / 'metrics.json'} holds a JSON list" in line for line in left_out)
    assert any(f"{runs / 'not-utf8' / 'predictions.jsonl'} line 1 is not a JSON record" in line for line in left_out)
    assert any("bytes_held" in line and "huge" in line for line in left_out)
    assert (tmp_path / "report" / "index.html").exists()


def test_a_failing_report_leaves_the_previous_one_as_it_was(monkeypatch, tmp_path):
    from evalkit.report import page as report
    from evalkit.report import plots

    runs = niah_store(tmp_path).parent
    report.build_report(runs, tmp_path / "report")
    before = {p.name: p.read_bytes() for p in (tmp_path / "report").iterdir()}

    def broken(*_):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(plots, "memory_png", broken)
    with pytest.raises(RuntimeError):
        report.build_report(runs, tmp_path / "report")
    assert {p.name: p.read_bytes() for p in (tmp_path / "report").iterdir()} == before


def test_heatmap_skips_a_torn_last_line_and_refuses_a_malformed_one(monkeypatch, capsys, tmp_path):
    folder = niah_store(tmp_path)
    with open(folder / "predictions.jsonl", "a") as file:
        file.write('{"id": "b", "score": 0.0, "meta": {"len')  # a run being written
    code, out, _ = evalkit(monkeypatch, capsys, "heatmap", str(folder), "-o", str(tmp_path / "h.png"))
    assert code == 0 and (tmp_path / "h.png").stat().st_size > 0

    (folder / "predictions.jsonl").write_bytes(b'{"id": "a", "score": 1.0}\n\xff\xfe\n')
    code, _, err = evalkit(monkeypatch, capsys, "heatmap", str(folder), "-o", str(tmp_path / "g.png"))
    assert code == 2 and err.strip() == (f"error: {folder / 'predictions.jsonl'} line 2 is not a JSON record "
                                         "(UnicodeDecodeError)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.png", "runs"]  # no g.png, no .tmp


@pytest.mark.model  # a sweep resolves the default model to plan
def test_sweep_dry_run_changes_nothing_on_disk(monkeypatch, capsys, tmp_path):
    from evalkit.config import RunConfig

    out = tmp_path / "runs"
    grid = ["sweep", "--policies", "h2o_head", "--budgets", "0.5", "--length", "512", "--samples", "2",
            "--out", str(out), "--dry-run"]
    code, plan, _ = evalkit(monkeypatch, capsys, *grid)
    assert code == 0 and not out.exists()
    assert "2 cells: 0 done, 0 partial, 2 to run; 4 of 4 cell-samples left" in plan  # the cell and its baseline
    folder = out / RunConfig(policy="h2o_head", budget=0.5, length=512, samples=2).validate().run_id()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "predictions.jsonl").write_text('{"id": "a"}\n{"id": "b", "pre')  # a torn last line
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}
    code, plan, _ = evalkit(monkeypatch, capsys, *grid)
    assert code == 0 and "partial (1 samples)" in plan
    assert "2 cells: 0 done, 1 partial, 1 to run; 3 of 4 cell-samples left" in plan
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()} == before


def test_report_names_the_incomplete_runs_in_one_line(monkeypatch, capsys, tmp_path):
    runs = niah_store(tmp_path).parent
    for name in ("b-running", "a-stopped"):  # a config and predictions, no metrics.json: not finished
        (runs / name).mkdir()
        (runs / name / "config.json").write_text(json.dumps({"config": {"policy": "h2o_head", "budget": 0.5}}))
        (runs / name / "predictions.jsonl").write_text(json.dumps({"id": "a", "score": 1.0}) + "\n")
    code, out, err = evalkit(monkeypatch, capsys, "report", str(runs), "-o", str(tmp_path / "report"))
    assert code == 0 and err == ""
    (line,) = [line for line in out.splitlines() if line.startswith("left out:")]
    assert line == "left out: incomplete runs (no metrics.json yet): a-stopped, b-running"
    assert "1 runs" in out
