"""Needle-in-a-haystack heatmaps of several `niah` runs side by side (`evalkit heatmap`), one panel
per run folder on one colour scale; one run's picture is `evalkit.tasks.niah_heatmap`.

    from evalkit.report.heatmap import write_side_by_side
    write_side_by_side(["runs/niah-full-1.0-...", "runs/niah-h2o_head-0.2-..."], "niah.png")
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable

from evalkit.errors import EvalkitError
from evalkit.results import RunDir, check_writable_file, read_json
from evalkit.tasks.niah_heatmap import draw_grid, grid_figure, run_title, save_png, score_grid

_PANELS_PER_ROW = 4


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def write_side_by_side(run_dirs: list[str | Path], path: str | Path, say: Callable[[str], None] = _note) -> Path:
    """One PNG with a heatmap per run folder (one per policy and budget), on a shared colour scale."""
    check_writable_file(path, "-o")
    return save_png(side_by_side_figure(run_dirs, say), path)


def side_by_side_figure(run_dirs: list[str | Path], say: Callable[[str], None] = _note):
    """A matplotlib Figure: one panel per run folder, up to four a row, and one colour bar for all. Runs that
    are not complete are drawn with the cells they have, and named in one `say` line."""
    if not run_dirs:
        raise EvalkitError("no run folders given")
    runs = [load_run(run_dir) for run_dir in run_dirs]
    grids = [score_grid(records, str(run_dir)) for run_dir, (records, _) in zip(run_dirs, runs)]
    incomplete = [f"{run_dir} ({why})" for run_dir, (records, _) in zip(run_dirs, runs)
                  if (why := incomplete_reason(run_dir, records))]
    if incomplete:
        say(f"note: incomplete runs, drawn with the cells they have: {', '.join(incomplete)}")
    columns = min(len(runs), _PANELS_PER_ROW)
    rows = math.ceil(len(runs) / columns)
    widest = max(grids, key=lambda g: len(g.lengths))
    figure = grid_figure(rows, columns, widest)
    image = None
    for index, (grid, (_, title)) in enumerate(zip(grids, runs)):
        image = draw_grid(figure.add_subplot(rows, columns, index + 1), grid, title)
    figure.colorbar(image, ax=figure.axes, label="score", shrink=0.9)
    return figure


def load_run(run_dir: str | Path) -> tuple[list[dict], str]:
    """(prediction records, panel title "policy @ budget") of a run folder; a torn last line (a run being
    written, or killed) is left out, any other malformed file refused naming it."""
    folder = Path(run_dir)
    store = RunDir(folder.parent, folder.name)
    if not store.config_path.is_file() or not store.predictions_path.is_file():
        raise EvalkitError(f"{folder} is not a run folder (no config.json and predictions.jsonl)")
    config = read_json(store.config_path).get("config")
    if not isinstance(config, dict):
        raise EvalkitError(f"{store.config_path} has no run config: not a run folder evalkit wrote")
    return store.predictions(), run_title(config)


def incomplete_reason(run_dir: str | Path, records: list[dict]) -> str | None:
    """Why a run folder's predictions are not the whole run (None when they are): the run has not finished
    (no metrics.json), or its predictions.jsonl holds fewer samples than its metrics counted."""
    folder = Path(run_dir)
    store = RunDir(folder.parent, folder.name)
    if not store.complete:
        return f"{len(records)} predictions, not finished"
    try:
        counted = store.metrics().get("samples")
    except EvalkitError:  # a damaged metrics.json says nothing about the count; the predictions are drawn
        return None
    if isinstance(counted, int) and len(records) < counted:
        return f"{len(records)} of {counted} predictions"
    return None
