"""`evalkit lm-eval ARGS`: lm-eval's own CLI with the `evalkit` model registered and implied, plus
`--out` and `--wandb`; each evaluation's results are written to `runs/<run_id>/` before W&B is told.

Nothing finished is lost: every model arg, `--out` and `--wandb` are checked before lm-eval indexes
its tasks, the tasks' data is loaded before the model, and results are written before W&B is told.
A refusal is one line: lm-eval's own log lines are held back until its checks have passed and the
tasks have loaded (then they go through); the default model is made only once lm-eval has found the tasks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Callable

from evalkit import assets
from evalkit.config import WANDB_MODES, choice
from evalkit.errors import EvalkitError
from evalkit.integrations import lm_eval as _model  # noqa: F401  (importing it registers --model evalkit)
from evalkit.integrations.lm_eval_options import (MODEL_NAME, RESULTS_KEY, default_model_folder, lm_eval_argv,
                                                  take_option)
from evalkit.integrations.wandb import decide_wandb_mode, log_run
from evalkit.results import RunDir, check_writable_folder, package_versions, write_json_atomic

_PACKAGES = ("evalkit", "lm_eval", "torch", "transformers", "datasets")
log = logging.getLogger(__name__)


# -- results in runs/ ----------------------------------------------------------------------

def save_run(results: dict, out: str | Path = "runs", wandb_mode: str | None = None,
             warn: Callable[[str], None] = log.warning) -> Path:
    """Write lm-eval's results of a `--model evalkit` evaluation to `out/<run_id>/`, then mirror them to
    W&B (`wandb_mode`, decided beforehand; None: decided now as `--wandb auto`); W&B trouble is one `warn`.

    config.json: the adapter's resolved args, tasks, lm-eval settings and package versions;
    metrics.json: lm-eval's per-task numbers flattened as "<task>/<metric>,<filter>", plus the
    kept-token and KV-byte statistics; predictions.jsonl: one line per request. An existing folder
    of the same run id is replaced (metrics.json, the completion mark, goes first and comes last).
    """
    info = (results or {}).get("config", {}).get(RESULTS_KEY)
    if info is None:
        raise EvalkitError("these lm-eval results do not come from --model evalkit: nothing to save")
    tasks = sorted(results.get("configs") or results.get("results", {}))
    lm_config = results["config"]
    # Without hyper-parameters the id is what it was before policy_args existed.
    left_out = ("batch_size",) + (() if info["args"].get("policy_args") else ("policy_args",))
    identity = {**{k: v for k, v in info["args"].items() if k not in left_out}, "tasks": tasks,
                "limit": lm_config.get("limit"), "n-shot": results.get("n-shot"),
                "gen_kwargs": lm_config.get("gen_kwargs")}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    label = tasks[0] if len(tasks) == 1 else f"{tasks[0]}+{len(tasks) - 1}" if tasks else "none"
    run_id = f"lm_eval-{label}-{info['args']['policy']}-{info['args']['budget']}-{digest}"
    versions = package_versions(_PACKAGES)
    config = {
        "config": {**info["args"], "task": "lm_eval:" + ",".join(tasks)},
        "kind": "lm_eval", "run_id": run_id, "tasks": tasks, "policy": info["policy"],
        "model_class": info.get("model_class"), "model_args": lm_config.get("model_args"),
        "lm_eval": {"limit": lm_config.get("limit"), "n-shot": results.get("n-shot"),
                    "gen_kwargs": lm_config.get("gen_kwargs"), "versions": results.get("versions"),
                    "random_seed": lm_config.get("random_seed")},
        "versions": versions, "python": platform.python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    metrics = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for name, value in values.items():
                if name not in ("alias", "name"):
                    metrics[f"{task}/{name}"] = value.item() if hasattr(value, "item") else value
    metrics.update(info["summary"])

    run_dir = RunDir(out, run_id)
    with run_dir.locked():
        run_dir.metrics_path.unlink(missing_ok=True)
        run_dir.start(config)
        run_dir.write_predictions(info["predictions"])  # one write and one fsync: thousands of requests
        write_json_atomic(run_dir.metrics_path, metrics)
    mode = wandb_mode or decide_wandb_mode("auto", warn)
    log_run(mode, run_dir.path, run_id, config, metrics, info["predictions"], warn)
    return run_dir.path


@contextlib.contextmanager
def _saving_runs(out: str | Path, wandb_mode: str, warn: Callable[[str], None],
                 checked: Callable[[], None] = lambda: None):
    """While lm-eval's CLI runs, save every evalkit result it computes to `out` as soon as it has it,
    then drop the per-request records from it (lm-eval's own output files stay their usual size).
    The tasks' data is loaded before the model, so a task that cannot load costs no model load; the
    embedded default model is made (downloaded and converted, the first time) only once lm-eval has found
    the tasks, before their data (RULER's loads its tokenizer); `checked` is called once the data is there.
    The CLI looks `simple_evaluate` up on the `lm_eval` package at call time: wrapped there, restored after.
    Yields (run folders saved, a list that is non-empty once lm-eval's own input checks have passed)."""
    import lm_eval
    from lm_eval import evaluator

    saved: list[Path] = []
    started: list[bool] = []
    real = evaluator.simple_evaluate

    def simple_evaluate(*args, **kwargs):
        started.append(True)
        if kwargs.get("model") == MODEL_NAME:
            model_args = kwargs.get("model_args")
            if isinstance(model_args, dict) and str(model_args.get("tokenizer")) == str(default_model_folder()):
                assets.default_model_dir()
            if kwargs.get("tasks") and kwargs.get("task_manager") is not None:
                kwargs["tasks"] = _load_tasks(kwargs["tasks"], kwargs["task_manager"])
        checked()
        results = real(*args, **kwargs)
        if results is not None and RESULTS_KEY in results.get("config", {}):
            saved.append(save_run(results, out, wandb_mode, warn))
            results["config"][RESULTS_KEY].pop("predictions", None)
        return results

    previous = vars(lm_eval).get("simple_evaluate")
    lm_eval.simple_evaluate = simple_evaluate
    try:
        yield saved, started
    finally:
        if previous is None:
            del lm_eval.simple_evaluate  # back to the package's lazy lookup
        else:
            lm_eval.simple_evaluate = previous


def _load_tasks(tasks: list, task_manager) -> list:
    """The requested tasks and groups, built (data included) now rather than after the model is loaded;
    lm-eval takes the built objects as they are."""
    try:
        loaded = task_manager.load(tasks)
    except Exception as error:  # datasets and lm-eval raise many types; all mean "this task cannot load"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise EvalkitError(f"cannot load lm-eval tasks {_names(tasks)}: {type(error).__name__}"
                           + (f": {reason}" if reason else "")) from None
    members = {name for children in loaded["group_map"].values() for name in children}
    return [built for name, built in {**loaded["groups"], **loaded["tasks"]}.items() if name not in members]


def _names(tasks: list) -> str:
    """Task names as lm-eval's CLI resolved them: names, or the configs of YAML files."""
    return ", ".join(str(t.get("task", t)) if isinstance(t, dict) else str(t) for t in tasks)


@contextlib.contextmanager
def _held_logs():
    """lm-eval's log lines (`--limit SHOULD ONLY BE USED FOR TESTING`, `Selected Tasks`, ...) held back while
    it checks its input, so that a refusal is the one error line alone. Yields the function that lets the
    held lines, and every later one, through; lines still held when lm-eval ends without an error go
    through then (`ls`), those held at a refusal are dropped."""
    from lm_eval.utils import setup_logging

    setup_logging()  # lm-eval's handler made now, to be held; cli_evaluate's own call then only sets the level
    logger = logging.getLogger("lm_eval")
    handlers, held = logger.handlers, _Holding()
    logger.handlers = [held]

    def release() -> None:
        if logger.handlers == [held]:
            logger.handlers = handlers
            for record in held.records:
                for handler in handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)

    try:
        yield release
        release()
    finally:
        if logger.handlers == [held]:
            logger.handlers = handlers


class _Holding(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _argv(argv: list[str]):
    previous = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = previous


def main(argv: list[str]) -> int:
    """`evalkit lm-eval ARGS`: lm-eval's own CLI (`lm_eval ARGS`) with `--model evalkit` registered and
    implied, plus `--out DIR` (default runs), where each evaluation's run folder is written, and
    `--wandb MODE` (as `evalkit run`'s, default auto)."""
    from lm_eval.__main__ import cli_evaluate

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    started: list[bool] = []
    try:
        out, argv = take_option(list(argv), "--out", "runs")
        wandb, argv = take_option(argv, "--wandb", "auto")
        choice("wandb", wandb, WANDB_MODES)
        lm_argv, ours = lm_eval_argv(argv)
        mode = "off"
        if ours:
            check_writable_folder(out, "--out")
            mode = decide_wandb_mode(wandb, lambda line: say(f"note: {line}"))
        with _argv(["lm-eval", *lm_argv]), _held_logs() as checked, \
                _saving_runs(out, mode, lambda line: say(f"warning: {line}"), checked) as (saved, started):
            cli_evaluate()
    except EvalkitError as error:
        say(f"error: {error}")
        return getattr(error, "exit_code", 2)  # 1 for results that could not be written (errors.WriteFailed)
    except SystemExit as done:  # argparse: --help, usage errors
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except (ValueError, TypeError, OSError) as error:
        if started:  # past lm-eval's input checks: a fault, not bad input
            raise
        # lm-eval's own checks of its arguments (no --tasks, unknown tasks, a bad --config file) raise these.
        say(f"error: lm-eval: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}")
        return 2
    for path in saved:
        print(f"evalkit results: {path}")
    return 0
