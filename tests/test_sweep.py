"""`evalkit sweep`: bad input refused before any cell; config files; a grid on the default model killed
with SIGKILL mid-cell and resumed; what W&B recorded offline; the Ray engine's run folders."""

import functools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_model_files
from helpers import evalkit

EVALKIT = str(Path(sys.executable).parent / "evalkit")
POLICIES, BUDGETS = ["h2o_head", "snapkv_head", "streaming_llm"], [0.1, 0.3, 0.5]
GRID = ["--policies", "h2o_head,snapkv,streaming_llm", "--budgets", "0.1,0.3,0.5", "--length", "512",
        "--samples", "2"]
RUN_ID = re.compile(r"niah_single_2-[a-z0-9_]+-[0-9.]+-[0-9a-f]{8}")


def run_folders(out: Path) -> dict[str, Path]:
    return {p.name: p for p in out.iterdir() if p.is_dir() and not p.name.startswith("_")}


# ---- bad input ---------------------------------------------------------------------------------------------

def _config(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# The cases marked `model` are refused while the sweep's cells are checked, after the default model is resolved.
@pytest.mark.parametrize("args, message", [
    pytest.param(["--policies", "h2o_head,h2o_haed"], "unknown policy 'h2o_haed' (did you mean 'h2o_head'?)",
                 marks=pytest.mark.model),
    pytest.param(["--tasks", "ruler:niah_single_2,ruler:nope"], "unknown task 'ruler:nope'", marks=pytest.mark.model),
    (["--budgets", "0.1,0"], "budget must be > 0, got 0"),
    (["--budgets", "0.5,-0.2"], "out of range"),
    (["--budgets", "0.5,1.5"], "out of range"),
    (["--policies", ""], "--policies is empty: give a comma-separated list"),
    (["--policies", "snapkv,,h2o_head"], "--policies has an empty item in 'snapkv,,h2o_head'"),
    (["--policies", "kvzip_head:layerwise=true", "--policy-arg", "layerwise=false"],
     "--policies item 'kvzip_head:layerwise=true' sets layerwise, which --policy-arg sets too: give it once"),
    (["--policies", "duo_attention@head_page", "--granularity", "head"],
     "--policies item 'duo_attention@head_page' names a granularity and --granularity head gives every policy"),
    pytest.param(["--policies", "h2o_token@head"], "h2o_token runs at granularity token", marks=pytest.mark.model),
    (["--policies", "kvzip_head:layerwise"], "policy-arg must be KEY=VALUE, got 'layerwise'"),
    (["--budgets", " , "], "--budgets is empty"),
    (["--tasks", ","], "--tasks is empty"),
    (["--length", "512,lots"], "--length takes whole numbers of tokens, got 'lots'"),
    (["--engine", "spark"], "unknown engine 'spark'; choose from local, ray"),
    pytest.param(["--layout", "sparse"], "unknown layout 'sparse'", marks=pytest.mark.model),
    (["--model", "./no/such/model"], "model path './no/such/model' does not exist"),
    pytest.param(["--limit", "3"], "--limit is for data tasks (jsonl:PATH, hf:NAME[:CONFIG]:SPLIT), and none of ruler:",
                 marks=pytest.mark.model),
    pytest.param(["--tasks", "jsonl:{tmp}/data.jsonl", "--samples", "3"], "--samples is not for data tasks",
                 marks=pytest.mark.model),
    pytest.param(["--kernels", "cuda"], "unknown kernels 'cuda'", marks=pytest.mark.model),
    (["--config", "{tmp}/missing.yaml"], "cannot read config file"),
    (["--config", "{tmp}/sweep.ini"], "unknown format '.ini'"),
    (["--config", "{tmp}/broken.yaml"], "cannot parse config file"),
    (["--config", "{tmp}/broken.toml"], "cannot parse config file"),
    (["--config", "{tmp}/list.yaml"], "must hold a mapping"),
    (["--config", "{tmp}/typo.yaml"], "unknown key 'polices'"),
    (["--config", "{tmp}/words.toml"], "words.toml: samples: "),  # then the flag type's own words
    (["--config", "{tmp}/zero.yaml"], "budget must be > 0, got 0"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_cell(monkeypatch, capsys, tmp_path, args, message):
    _config(tmp_path, "sweep.ini", "policies = h2o_head\n")
    _config(tmp_path, "broken.yaml", "policies: [h2o_head\n")
    _config(tmp_path, "broken.toml", "policies = [\n")
    _config(tmp_path, "list.yaml", "- h2o_head\n- snapkv\n")
    _config(tmp_path, "typo.yaml", "polices: h2o_head\n")
    _config(tmp_path, "words.toml", 'samples = "ten"\n')
    _config(tmp_path, "zero.yaml", "budgets: [0.5, 0]\n")
    _write_kvpress(tmp_path / "data.jsonl", 2)
    out = tmp_path / "runs"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, _, err = evalkit(monkeypatch, capsys, "sweep", *args, "--out", str(out), "--wandb", "off")
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.model  # a sweep resolves the default model to plan
def test_config_files_and_flags_make_the_same_grid(monkeypatch, capsys, tmp_path):
    """YAML, TOML and JSON files give the grid the flags give; a flag overrides the file."""
    flags = ["--policies", "h2o_head,snapkv", "--budgets", "0.2,64", "--tasks", "niah_single_2,ruler:vt",
             "--length", "600,900", "--samples", "3", "--block-size", "8", "--query-agnostic"]
    files = {
        "sweep.yaml": "policies: [h2o_head, snapkv]\nbudgets: [0.2, 64]\ntasks: niah_single_2, ruler:vt\n"
                      "length: [600, 900]\nsamples: 5\nblock-size: 8\nquery_aware: false\n",
        "sweep.toml": 'policies = ["h2o_head", "snapkv"]\nbudgets = [0.2, 64]\ntasks = ["niah_single_2", "ruler:vt"]\n'
                      'length = [600, 900]\nsamples = 5\nblock_size = 8\nquery_aware = false\n',
        "sweep.json": json.dumps({"policies": "h2o_head,snapkv", "budgets": [0.2, 64], "tasks": ["niah_single_2",
                                  "ruler:vt"], "length": "600,900", "samples": 5, "block_size": 8,
                                  "query_aware": False}),
    }

    def planned(*args):
        code, out, err = evalkit(monkeypatch, capsys, "sweep", *args, "--out", str(tmp_path / "runs"), "--dry-run")
        assert code == 0, err
        return RUN_ID.findall(out) + re.findall(r"vt-[a-z0-9_]+-[0-9.]+-[0-9a-f]{8}", out)

    expected = planned(*flags)
    # 2 tasks × 2 lengths × (baseline + 2 policies × 2 budgets)
    assert len(expected) == len(set(expected)) == 2 * 2 * 5
    for name, text in files.items():
        assert planned("--config", _config(tmp_path, name, text), "--samples", "3") == expected, name
    assert planned("--config", str(tmp_path / "sweep.yaml")) != expected  # samples 5 from the file
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.model  # a sweep resolves the default model to plan
def test_a_grid_item_names_its_granularity_and_its_own_policy_args(tmp_path):
    """`name@granularity` and `name:KEY=VALUE` make the cells `evalkit run --granularity` and `--policy-arg` make,
    beside the plain policy in the same grid (so in the same prefill group), each labelled as the grid wrote it."""
    import typer

    from evalkit.cli import app
    from evalkit.config import RunConfig
    from evalkit.sweep.plan import plan_sweep, prefill_groups, resolve_settings

    command = typer.main.get_command(app).commands["sweep"]
    policies = "kvzip_head,kvzip_head:layerwise=true,duo_attention@head_page,h2o_token"
    ctx = command.make_context("sweep", ["--policies", policies, "--budgets", "0.2", "--tasks", "ruler:niah_single_2",
                                         "--length", "512", "--policy-arg", "sink_tokens=2",
                                         "--out", str(tmp_path / "runs")])
    plan = plan_sweep(resolve_settings(ctx, None))
    grid = [cell for cell in plan.cells if not cell.baseline]
    assert [cell.policy for cell in grid] == ["kvzip_head", "kvzip_head:layerwise=true", "duo_attention@head_page",
                                              "h2o_token"]
    assert plan.settings["policies"] == [cell.policy for cell in grid]
    own = dict(task="ruler:niah_single_2", length=512, budget=0.2, out=str(tmp_path / "runs"))
    expected = [RunConfig(policy="kvzip_head", policy_args={"sink_tokens": "2"}, **own),
                RunConfig(policy="kvzip_head", policy_args={"sink_tokens": "2", "layerwise": "true"}, **own),
                RunConfig(policy="duo_attention", granularity="head_page", policy_args={"sink_tokens": "2"}, **own),
                RunConfig(policy="h2o_token", policy_args={"sink_tokens": "2"}, **own)]
    assert [cell.run_id for cell in grid] == [config.run_id() for config in expected]
    assert len({cell.run_id for cell in grid}) == 4
    assert [len(group) for group in prefill_groups(plan)] == [5]  # with the baseline: one prefill a sample


def _write_kvpress(path: Path, records: int) -> None:
    path.write_text("".join(json.dumps({"context": f"The code is {i}{i}{i}.", "question": "What is the code?",
                                        "answers": [f"{i}{i}{i}"], "max_new_tokens": 8}) + "\n"
                            for i in range(records)))


@pytest.mark.model  # a sweep resolves the default model to plan
def test_data_options_reach_data_tasks_and_samples_the_registered_ones(tmp_path):
    """In a grid of a registered task and a data file, --samples sizes the one, --limit selects from the other."""
    import typer

    from evalkit.cli import app
    from evalkit.sweep.plan import plan_sweep, resolve_settings

    _write_kvpress(tmp_path / "data.jsonl", 5)
    command = typer.main.get_command(app).commands["sweep"]
    ctx = command.make_context("sweep", ["--policies", "h2o_head", "--budgets", "0.5", "--tasks",
                                         f"ruler:niah_single_2,jsonl:{tmp_path / 'data.jsonl'}", "--samples", "3",
                                         "--limit", "2", "--offset", "1", "--out", str(tmp_path / "runs")])
    plan = plan_sweep(resolve_settings(ctx, None))
    # The same from a file whose keys are flag names (`format`) or RunConfig's (`task_args`).
    config = _config(tmp_path, "sweep.yaml", f"policies: h2o_head\nbudgets: 0.5\ntasks: [ruler:niah_single_2, "
                     f"'jsonl:{tmp_path / 'data.jsonl'}']\nsamples: 3\nlimit: 2\noffset: 1\nformat: kvpress\n"
                     f"out: {tmp_path / 'runs'}\n")
    from_file = plan_sweep(resolve_settings(command.make_context("sweep", ["--config", config]), Path(config)))
    assert [c.run_id for c in from_file.cells] == [c.run_id for c in plan.cells]
    by_task = {}
    for cell in plan.cells:
        by_task.setdefault(cell.config.task.split(":")[0], []).append(cell.config)
    assert len(by_task["ruler"]) == len(by_task["jsonl"]) == 2  # the baseline and h2o_head at 0.5
    assert all(c.samples == 3 and c.limit is None for c in by_task["ruler"])
    assert all(c.samples == 2 and c.offset == 1 for c in by_task["jsonl"])


# ---- a real grid, killed once and resumed -----------------------------------------------------------------

@functools.cache
def _killed_and_resumed(root: Path) -> dict:
    """Runs GRID on the default model in a subprocess, SIGKILLs it while its cells are half done (they
    share one prefill per sample, so they advance together: killed once at least two have their first
    sample), then reruns it to the end. Returns what was on disk at the kill and the output."""
    out = root / "runs"
    command = [EVALKIT, "sweep", *GRID, "--out", str(out), "--wandb", "offline"]
    # One torch thread: on a busy 2-core machine two threads spin against each other (measured 3x slower).
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    killed = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)  # its own process group: W&B's helper dies with it
    at_kill, deadline = None, time.monotonic() + 900
    while killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if not out.exists() or len(list(out.glob("*/predictions.jsonl"))) < 2:
            continue
        os.killpg(killed.pid, signal.SIGSTOP)  # frozen, the folders cannot change while we look
        folders = list(run_folders(out).values())
        complete = [f for f in folders if (f / "metrics.json").exists()]
        partial = [f for f in folders if not (f / "metrics.json").exists() and (f / "predictions.jsonl").exists()
                   and (f / "predictions.jsonl").read_text().count("\n") == 1]
        if len(partial) < 2:
            os.killpg(killed.pid, signal.SIGCONT)
            continue
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        at_kill = {
            "complete": {f.name: (f / "metrics.json").read_bytes() for f in complete},
            "partial": {f.name: (f / "predictions.jsonl").read_text() for f in partial},
            "folders": {f.name: sorted(p.name for p in f.iterdir()) for f in folders},
        }
        break
    if at_kill is None:
        killed.kill()
        killed.wait()
        raise AssertionError(f"the sweep ended before it could be killed mid-cell: {killed.stderr.read()[-2000:]}")
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    return {"out": out, "at_kill": at_kill, "resumed": resumed}


@pytest.fixture
@needs_model_files  # a sweep on the default model
def swept(tmp_path_factory):
    """The killed-and-resumed sweep, computed once per session (the report tests reuse it)."""
    return _killed_and_resumed(tmp_path_factory.getbasetemp() / "sweep")


@pytest.mark.model  # swept: a sweep on the default model
def test_dry_run_says_how_many_samples_each_cell_needs(swept, monkeypatch, capsys, tmp_path):
    from evalkit.uncertainty import samples_needed

    out = swept["out"]
    code, plan, err = evalkit(monkeypatch, capsys, "sweep", *GRID, "--out", str(out), "--dry-run", "--detect", "10")
    assert code == 0, err
    folders = run_folders(out)
    (full,) = [f for name, f in folders.items() if "-full-" in name]
    base = {r["id"]: r["score"] for r in map(json.loads, (full / "predictions.jsonl").read_text().splitlines())}
    for name, folder in folders.items():
        (row,) = [line for line in plan.splitlines() if name in line]
        if folder == full:
            assert row.rstrip(" │").endswith("-")
            continue
        own = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
        disagree = sum(r["score"] != base[r["id"]] for r in own) / len(own)  # the needles: found or not
        assert row.rstrip(" │").endswith(str(samples_needed(0.10, discordance=disagree or None))), row
    code, plan, _ = evalkit(monkeypatch, capsys, "sweep", *GRID, "--out", str(tmp_path / "none"), "--dry-run",
                            "--detect", "20")
    assert code == 0 and plan.count(f"{samples_needed(0.20)} (default)") == 9  # nothing run: the default
    code, _, err = evalkit(monkeypatch, capsys, "sweep", *GRID, "--out", str(tmp_path / "none"), "--detect", "20")
    assert code == 2 and "give it with --dry-run" in err


@pytest.mark.model  # swept: a sweep on the default model
def test_killed_sweep_resumes_to_exactly_the_grid(swept, monkeypatch, capsys):
    out, at_kill, resumed = swept["out"], swept["at_kill"], swept["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # At the kill: cells in progress hold their first sample and no metrics.json; none was complete
    # (cells sharing a prefill finish together).
    assert len(at_kill["partial"]) >= 2 and not at_kill["complete"]
    for partial in at_kill["partial"]:
        assert "metrics.json" not in at_kill["folders"][partial]

    folders = run_folders(out)
    assert len(folders) == 10  # 3 policies × 3 budgets + the full-cache baseline
    code, plan, _ = evalkit(monkeypatch, capsys, "sweep", *GRID, "--out", str(out), "--dry-run")
    assert code == 0 and set(RUN_ID.findall(plan)) == set(folders)
    assert plan.count(" done ") == 10 and "10 cells: 10 done, 0 partial, 0 to run; 0 of 20 cell-samples left" in plan
    for name, folder in folders.items():
        metrics = json.loads((folder / "metrics.json").read_text())
        lines = (folder / "predictions.jsonl").read_text().splitlines()
        assert metrics["samples"] == len(lines) == 2, name
        assert not list(folder.glob("*.tmp")), name
    cells = {(c["policy"], c["budget"]) for c in
             (json.loads((f / "config.json").read_text())["config"] for f in folders.values())}
    assert cells == {(p, b) for p in POLICIES for b in BUDGETS} | {("full", 1.0)}
    # Nothing finished was recomputed: each half-done cell kept its first sample's line, byte for byte.
    for partial, first_line in at_kill["partial"].items():
        assert (folders[partial] / "predictions.jsonl").read_text().startswith(first_line), partial
    # The grid table: every policy and budget, and the baseline's score.
    full = json.loads(next(f for n, f in folders.items() if "-full-" in n).joinpath("metrics.json").read_text())
    assert f"full cache {100 * full['score']:.1f}" in resumed.stdout
    assert all(policy in resumed.stdout for policy in POLICIES)


# ---- W&B, read back from the offline files ----------------------------------------------------------------

def wandb_records(run_folder: Path):
    """The records of an offline W&B run, from its .wandb file: LevelDB's log format (32 KiB blocks of
    chunks, each with a 7-byte header: CRC32C, length, kind) carrying protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        position += 7
        pending += raw[position:position + length]
        position += length
        if kind in (1, 4):  # a FULL chunk, or the LAST of a split record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_summary(records) -> dict:
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return summary


def wandb_run(records):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


@pytest.mark.model  # swept: a sweep on the default model
def test_wandb_records_every_cell_and_the_sweep_curves(swept):
    out = swept["out"]
    (sweep_dir,) = (out / "_sweeps").iterdir()
    sweep_id = sweep_dir.name
    folders = run_folders(out)
    metrics = {name: json.loads((f / "metrics.json").read_text()) for name, f in folders.items()}
    configs = {name: json.loads((f / "config.json").read_text())["config"] for name, f in folders.items()}

    for name, folder in folders.items():  # each cell: its own run, in the sweep's group, its numbers
        runs = sorted(folder.glob("wandb/offline-run-*"))
        assert runs, name
        records = list(wandb_records(runs[-1]))
        assert wandb_run(records).run_group == sweep_id
        assert wandb_run(records).run_id == name
        summary = wandb_summary(records)
        assert summary["score"] == pytest.approx(metrics[name]["score"])
        assert (summary["ci_low"], summary["ci_high"], summary["n"]) == \
            (metrics[name]["ci_low"], metrics[name]["ci_high"], metrics[name]["n"])  # the interval too
        assert list(runs[-1].glob("files/media/table/predictions_*.table.json"))

    (sweep_run,) = sweep_dir.glob("wandb/offline-run-*")
    records = list(wandb_records(sweep_run))
    assert wandb_run(records).run_group == sweep_id and wandb_run(records).job_type == "sweep"
    by_cell = {(configs[n]["policy"], configs[n]["budget"]): metrics[n] for n in folders}
    full = by_cell[("full", 1.0)]["score"]

    def lines(kind):
        (table,) = sweep_run.glob(f"files/media/table/{kind}/*.table.json")
        data = json.loads(table.read_text())
        assert data["columns"] == ["step", "lineKey", "lineVal"]
        return {(key, x): y for x, key, y in data["data"]}

    quality = lines("quality_vs_budget")
    assert quality == {**{(p, b): by_cell[(p, b)]["score"] for p in POLICIES for b in BUDGETS},
                       ("full cache", 0.1): full, ("full cache", 1.0): full}
    memory = lines("memory_vs_budget")
    assert memory == {(p, b): by_cell[(p, b)]["held_over_full"] for p in POLICIES for b in BUDGETS}
    # A chart per scorer, a line per granularity (here each scorer ran at one); the cells table says both, so
    # that a W&B report can group its panels by them (docs/sweeps.md).
    for policy, scorer in zip(POLICIES, ("h2o", "snapkv", "streaming_llm")):
        (table,) = sweep_run.glob(f"files/media/table/granularities/ruler-niah_single_2-512/{scorer}_*.table.json")
        data = json.loads(table.read_text())["data"]
        assert {(key, x): y for x, key, y in data} == {("head", b): by_cell[(policy, b)]["score"] for b in BUDGETS}
    (cells,) = sweep_run.glob("files/media/table/cells_*.table.json")
    cells = json.loads(cells.read_text())
    assert {"scorer", "granularity", "policy", "budget", "score", "relative_score", "held_over_full", "query_aware",
            "model", "task", "length"} <= set(cells["columns"])
    assert {row[cells["columns"].index("granularity")] for row in cells["data"]} == {"head"}
    summary = wandb_summary(records)
    for policy in POLICIES:  # trapezoids over 0.1 -> 0.3 -> 0.5 -> (1, full), over a width of 0.9
        s = [by_cell[(policy, b)]["score"] for b in BUDGETS]
        area = 0.2 * (s[0] + s[1]) / 2 + 0.2 * (s[1] + s[2]) / 2 + 0.5 * (s[2] + full) / 2
        assert summary[f"auc/ruler-niah_single_2-512/{policy}"] == pytest.approx(area / 0.9)


# ---- Ray ------------------------------------------------------------------------------------------------

@pytest.mark.model  # swept: a sweep on the default model
def test_ray_engine_writes_the_same_run_folders_as_the_local_engine(swept, tmp_path):
    """A small grid through a local Ray instance: the same run ids, configs and predictions."""
    out = tmp_path / "ray-runs"
    done = subprocess.run([EVALKIT, "sweep", "--engine", "ray", "--policies", "snapkv,streaming_llm",
                           "--budgets", "0.3", "--length", "512", "--samples", "2", "--out", str(out),
                           "--wandb", "off"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    local = run_folders(swept["out"])
    ray_folders = run_folders(out)
    assert len(ray_folders) == 3 and set(ray_folders) <= set(local)
    for name, folder in ray_folders.items():
        ours, theirs = (json.loads((f / "config.json").read_text()) for f in (folder, local[name]))
        assert ours["run_id"] == theirs["run_id"] == name
        assert ours["config"]["out"] == str(out)  # where the result lives, not the worker's scratch
        ignore = ("out", "wandb")
        assert {k: v for k, v in ours["config"].items() if k not in ignore} == \
            {k: v for k, v in theirs["config"].items() if k not in ignore}
        keys = ("id", "prediction", "score", "kept_tokens", "bytes_held", "prompt_tokens")
        mine, local_records = ([{k: json.loads(line)[k] for k in keys} for line in
                                (f / "predictions.jsonl").read_text().splitlines()] for f in (folder, local[name]))
        assert mine == local_records, name
        assert (folder / "metrics.json").exists()
