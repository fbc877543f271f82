"""A niah run's heatmap: depth × context length, coloured by score (the niah grid's artifact).

A cell's score is the mean score of the run's samples with that length and depth
(their `meta["length"]`, `meta["depth"]` in predictions.jsonl). Colours run
red (0) to green (1) on the same fixed scale in every picture, so pictures
and panels compare directly; a cell with no sample is grey. Drawn with
matplotlib's object API (no pyplot): nothing global changes. Several runs side
by side: `evalkit.report.heatmap`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evalkit.errors import EvalkitError

_COLOURS = "RdYlGn"
_ANNOTATE_UP_TO = 12  # cells per side beyond which numbers would not fit in the squares


@dataclass(frozen=True)
class ScoreGrid:
    lengths: tuple[int, ...]  # columns, ascending
    depths: tuple[float, ...]  # rows, ascending (depth 0 drawn at the top)
    scores: np.ndarray  # [depths, lengths] mean score per cell, NaN where no sample
    counts: np.ndarray  # [depths, lengths] samples per cell


def score_grid(records: list[dict], source: str = "run") -> ScoreGrid:
    """Mean score per (depth, length) cell of a niah run's prediction records."""
    cells: dict[tuple[float, int], list[float]] = {}
    for record in records:
        meta = record.get("meta")
        if not isinstance(meta, dict) or "length" not in meta or "depth" not in meta:
            raise EvalkitError(f"{source} is not a niah grid run: its predictions have no length and depth")
        try:
            cell, score = (float(meta["depth"]), int(meta["length"])), float(record["score"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise EvalkitError(f"{source}: prediction {record.get('id')!r} has no numeric score, length and depth") \
                from None
        if not (math.isfinite(cell[0]) and math.isfinite(score)):
            raise EvalkitError(f"{source}: prediction {record.get('id')!r} has a score or depth that is not finite")
        cells.setdefault(cell, []).append(score)
    if not cells:
        raise EvalkitError(f"{source} has no predictions")
    depths = tuple(sorted({depth for depth, _ in cells}))
    lengths = tuple(sorted({length for _, length in cells}))
    scores = np.full((len(depths), len(lengths)), np.nan)
    counts = np.zeros((len(depths), len(lengths)), dtype=int)
    for (depth, length), values in cells.items():
        row, column = depths.index(depth), lengths.index(length)
        scores[row, column] = sum(values) / len(values)
        counts[row, column] = len(values)
    return ScoreGrid(lengths, depths, scores, counts)


def write_heatmap(records: list[dict], path: str | Path, title: str) -> Path:
    """One run's heatmap as a PNG at `path`."""
    grid = score_grid(records, title)
    figure = grid_figure(1, 1, grid)
    image = draw_grid(figure.add_subplot(1, 1, 1), grid, title)
    figure.colorbar(image, ax=figure.axes, label="score", shrink=0.9)
    return save_png(figure, path)


def run_title(config: dict) -> str:
    """"h2o_head @ 0.2", with a granularity override and query-agnostic compression named when set."""
    policy = config.get("policy", "?")
    if config.get("granularity"):
        policy += f" [{config['granularity']}]"
    agnostic = "" if config.get("query_aware", True) else ", query-agnostic"
    return f"{policy} @ {config.get('budget', '?')}{agnostic}"


def grid_figure(rows: int, columns: int, grid: ScoreGrid):
    from matplotlib.figure import Figure

    width = 1.6 + 0.55 * max(len(grid.lengths), 4)
    height = 1.2 + 0.4 * max(len(grid.depths), 4)
    return Figure(figsize=(columns * width + 1.2, rows * height), layout="constrained")


def draw_grid(axes, grid: ScoreGrid, title: str):
    """The grid as an image on `axes`: lengths across, depths down, colour 0..1; returns the AxesImage."""
    from matplotlib import colormaps

    colours = colormaps[_COLOURS].with_extremes(bad="#d0d0d0")
    image = axes.imshow(np.ma.masked_invalid(grid.scores), cmap=colours, vmin=0.0, vmax=1.0, aspect="auto",
                        interpolation="nearest")
    axes.set_xticks(range(len(grid.lengths)), [str(length) for length in grid.lengths],
                    rotation=45 if len(grid.lengths) > 6 else 0)
    axes.set_yticks(range(len(grid.depths)), [f"{depth:g}" for depth in grid.depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth (%)")
    axes.set_title(title)
    if max(grid.scores.shape) <= _ANNOTATE_UP_TO:
        for (row, column), value in np.ndenumerate(grid.scores):
            if not np.isnan(value):
                axes.text(column, row, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    return image


def save_png(figure, path: str | Path) -> Path:
    """Written to a temporary name and renamed: an interrupted write leaves no half picture."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    try:
        figure.savefig(partial, format="png", dpi=100)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
