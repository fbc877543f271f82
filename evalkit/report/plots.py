"""The report's plots of each task (matplotlib PNGs beside the page; the page's own plot, the answer, is drawn
in the browser from `report.answer`'s data).

Each takes the lines to draw (label -> runs of `page.Entry`, in order along x) and the full-cache
reference (its score; for the memory plot its run), as `evalkit.report.page` chose them.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

Lines = dict[str, list]  # label -> runs (evalkit.report.page.Entry), in order along the x axis


def block_size_png(lines: Lines, full: float | None, setting: str, path: Path) -> None:
    figure, axes = _axes(f"Quality vs block size: {setting}")
    sizes = set()
    for label, members in lines.items():
        sizes |= {e.config["block_size"] for e in members}
        axes.plot([e.config["block_size"] for e in members], [100 * e.metrics["score"] for e in members], marker="o",
                  label=label)
    if full is not None:
        axes.axhline(100 * full, color="gray", linestyle="--", label="full cache")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(sizes), [str(size) for size in sorted(sizes)])
    axes.minorticks_off()
    axes.set_xlabel("block size (tokens per page)")
    axes.set_ylabel("score (%)")
    _save(figure, axes, path)


def _error_bars(members) -> list[list[float]]:
    """[below, above] in points: each run's 95 % interval around its score (0 where it has none)."""
    bars = [[], []]
    for e in members:
        interval, score = e.interval, 100 * e.metrics["score"]
        known = interval is not None and interval.ci_low is not None
        bars[0].append(score - 100 * interval.ci_low if known else 0.0)
        bars[1].append(100 * interval.ci_high - score if known else 0.0)
    return bars


def _axes(title: str):
    figure = Figure(figsize=(8, 4.2), dpi=110)  # no pyplot: no global figure state, no GUI backend
    axes = figure.add_subplot()
    axes.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)  # distinct colours for up to 20 policies
    axes.set_title(title, fontsize=10)
    axes.set_ylim(-3, 103)
    axes.grid(alpha=0.3)
    return figure, axes


def _save(figure, axes, path: Path) -> None:
    if axes.get_legend_handles_labels()[0]:  # a setting with only its full-cache run has nothing to name
        axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.savefig(path, bbox_inches="tight")


def quality_png(lines: Lines, full: float | None, setting: str, path: Path) -> None:
    """Each run's score with its 95 % interval as an error bar."""
    figure, axes = _axes(f"Quality vs budget: {setting}")
    for series, members in lines.items():
        axes.errorbar([e.x for e in members], [100 * e.metrics["score"] for e in members], yerr=_error_bars(members),
                      marker="o", capsize=3, label=series)
    if full is not None:
        axes.axhline(100 * full, color="gray", linestyle="--", label="full cache")
    axes.set_xlim(0, 1.02)
    axes.set_xlabel("budget (fraction of the prompt kept)")
    axes.set_ylabel("score (%)")
    _save(figure, axes, path)


def memory_png(lines: Lines, full, setting: str, path: Path) -> None:
    figure, axes = _axes(f"Memory vs quality: {setting}")
    for series, members in lines.items():
        members = sorted(members, key=lambda e: e.metrics["held_over_full"])
        axes.plot([100 * e.metrics["held_over_full"] for e in members], [100 * e.metrics["score"] for e in members],
                  marker="o", label=series)
    if full is not None:
        axes.plot([100 * full.metrics["held_over_full"]], [100 * full.metrics["score"]], marker="*",
                  markersize=12, color="gray", linestyle="none", label="full cache")
    axes.set_xlabel("KV cache held (% of the full cache)")
    axes.set_ylabel("score (%)")
    _save(figure, axes, path)
