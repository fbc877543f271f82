"""`evalkit bench`'s grid, measured: every cell (`cells.BenchCell`, by `generations.measure_cell`) and
component point in its own process, under a progress bar; what is measured is kept in `<out>/bench.json`
after every cell (a rerun with the same settings measures only what is missing); then the targets
(`evalkit.bench.targets`), the tables and the plots.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from evalkit.bench import components, isolation
from evalkit.bench.cells import BenchCell, BenchSettings, grid_cells
from evalkit.bench.checks import BenchGrid
from evalkit.bench.generations import measure_cell
from evalkit.bench.report import plot_cells, plot_components, print_report
from evalkit.bench.targets import compare_with_full, targets
from evalkit.errors import EvalkitError
from evalkit.policies import make_policy
from evalkit.results import package_versions, read_json, write_json_atomic

COMPONENT_THREADS = 1


def measure(settings: BenchSettings, grid: BenchGrid, with_components: bool, out_dir: str, fresh: bool) -> None:
    """Measures what `<out>/bench.json` lacks (everything with `fresh`), then writes it whole with the
    targets, prints the tables and draws `bench.png` and `components.png`."""
    err = Console(stderr=True)
    out = Console(width=max(Console().width, 170))  # wide tables stay readable when piped to a file
    folder = Path(out_dir)
    json_path = folder / "bench.json"
    cells = grid_cells(grid.policies, grid.budgets, grid.layouts, grid.lengths, grid.granularities)
    evicting = [p for p in grid.policies if make_policy(p).evicts]
    shape = components.HeadShape.of(grid.model_config, grid.torch_dtype, grid.torch_device)
    points = (components.measurement_points(grid.lengths, evicting, grid.budgets[0], settings.block_size,
                                            components.prefill_routes(grid.torch_device))
              if with_components else [])

    previous = _previous(json_path, asdict(settings), fresh)
    measured = {row["key"]: row for row in previous.get("cells", [])}
    old_components = previous.get("components") or {}
    reuse_components = old_components.get("plan") == _points_spec(points, shape) and bool(points)
    document = {"settings": asdict(settings), "grid": grid.spec(), "environment": _environment(grid),
                "cells": [], "components": None, "targets": [], "complete": False}
    folder.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if c.key not in measured]
    err.print(f"{len(cells)} cells ({len(cells) - len(todo)} already measured in {json_path}), "
              f"{0 if reuse_components else len(points)} component points")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, transient=True, disable=not err.is_terminal)  # as runner.py's
    preload = tuple(m for m in ("transformers.generation.utils", isolation.model_module(grid.model_config)) if m)
    with isolation.Isolated(preload) as isolated, progress:
        bar = progress.add_task("bench", total=len(cells) + (0 if reuse_components else len(points)))
        _measure_cells(isolated, settings, cells, measured, document, json_path, progress, bar)
        if reuse_components:
            document["components"] = old_components
        elif points:
            results = _measure_components(isolated, points, shape, lambda text: progress.update(bar, description=text),
                                          lambda: progress.advance(bar))
            document["components"] = {"plan": _points_spec(points, shape), "shape": asdict(shape),
                                      **components.summarise(results, grid.lengths)}

    rows = [measured[c.key] for c in cells]
    compare_with_full(rows)
    collects = {p for p in grid.policies if make_policy(p).collect_prefill == "attention"}
    document.update(cells=rows, targets=targets(rows, collects, settings.block_size), complete=True)
    document["environment"]["load_average_end"] = os.getloadavg()[0]
    write_json_atomic(json_path, document)
    _show(out, document, settings, folder, several_layouts=len(grid.layouts) > 1)


def _environment(grid: BenchGrid) -> dict:
    """Where and with what the grid is measured, as bench.json records it (the load average at the start)."""
    return {
        "command": shlex.join(["evalkit", *sys.argv[1:]]),
        "started": datetime.datetime.now().isoformat("T", "seconds"),
        "device": str(grid.torch_device), "dtype": str(grid.torch_dtype), "cpu_count": os.cpu_count(),
        # what the loop's attention dispatch ("auto") picks on this device
        "attention": "Triton kernels" if grid.torch_device.type == "cuda" else "torch reference",
        "python": platform.python_version(),
        "versions": package_versions(("torch", "transformers", "triton", "evalkit")),
        "load_average_start": os.getloadavg()[0],
    }


def _measure_cells(isolated, settings: BenchSettings, cells: list[BenchCell], measured: dict[str, dict],
                   document: dict, json_path: Path, progress: Progress, bar) -> None:
    """Every cell not yet in `measured` (by key), each in its own process, added to `measured` and to
    `document`'s cells, which is written to `json_path` after each."""
    for cell in cells:
        if cell.key not in measured:
            progress.update(bar, description=f"{cell.label} · {cell.layout} · {cell.length} tokens")
            row = isolated.run(settings.threads, measure_cell, settings, cell)
            row["load_average"] = os.getloadavg()[0]
            measured[cell.key] = row
            # Saved after every cell: an interrupted bench keeps what it measured and resumes.
            document["cells"] = [measured[c.key] for c in cells if c.key in measured]
            write_json_atomic(json_path, document)
        progress.advance(bar)


def _show(out: Console, document: dict, settings: BenchSettings, folder: Path, several_layouts: bool) -> None:
    """The measured grid drawn (bench.png, and components.png where components were measured) and printed."""
    title = (f"{settings.model} · {document['environment']['device']} · {settings.new_tokens} new tokens · "
             f"batch {settings.batch}")
    plot_cells(document["cells"], folder / "bench.png", title)
    if document["components"]:
        plot_components(document["components"], folder / "components.png",
                        f"one layer of {settings.model} ({COMPONENT_THREADS} thread)")
    print_report(out, document, several_layouts)
    out.print(f"results: {folder / 'bench.json'}, {folder / 'bench.png'}"
              + (f", {folder / 'components.png'}" if document["components"] else ""))


def _measure_components(isolated, points: list[tuple], shape, describe, advance) -> dict[str, list[dict]]:
    """Every component point, each in its own process on one thread (the pieces' scaling, undisturbed by
    parallel regions stalling on a busy machine); grouped by component."""
    results: dict[str, list[dict]] = {}
    for component, fn, args in points:
        describe(f"{component} {args}")
        results.setdefault(component, []).append(isolated.run(COMPONENT_THREADS, fn, shape, *args))
        advance()
    return results


def _previous(json_path: Path, settings: dict, fresh: bool) -> dict:
    """What an earlier bench in this folder measured, if it used the same settings."""
    if fresh or not json_path.exists():
        return {}
    try:
        previous = read_json(json_path)
    except EvalkitError as error:
        raise EvalkitError(f"{error}: pass --fresh to replace it") from None
    if previous.get("settings") != settings:
        raise EvalkitError(f"{json_path} was measured with other settings: pass --fresh to replace it, "
                           "or choose another --out")
    return previous


def _points_spec(points: list[tuple], shape) -> list:
    return [asdict(shape)] + [[component, list(args)] for component, _, args in points]
