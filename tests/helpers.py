"""Helpers several test modules share: the command line run in-process, a run folder read back, the fast tier's
sample of a big case table."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from evalkit.cli import main


def evalkit(monkeypatch, capsys, *args):
    """`evalkit *args` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["evalkit", *args])
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli(*args) -> tuple[int, str, str]:
    """`evalkit *args` in this process without pytest's fixtures (module-scoped fixtures call it)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["evalkit", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as done:
                code = done.code
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def read_run(out: Path, policy: str):
    """(folder, predictions, metrics) of the one run of `policy` under `out`."""
    (run_dir,) = [p for p in out.iterdir() if f"-{policy}-" in p.name]
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return run_dir, records, json.loads((run_dir / "metrics.json").read_text())
