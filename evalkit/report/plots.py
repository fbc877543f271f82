"""The report's plots of each task (matplotlib PNGs beside the page; the page's own plot, the answer, is drawn
in the browser from `report.answer`'s data).

Each takes the lines to draw (label -> runs of `page.Entry`, in order along x) and the full-cache
reference (its score; for the memory plot its run), as `evalkit.report.page` chose them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from evalkit.config import fields_where
from evalkit.report.answer import as_text, policy_name
from evalkit.report.leaderboard import is_number

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


def turns_png(lines: Lines, full, setting: str, path: Path) -> None:
    """A multi-turn task: each run's score by turn with its 95 % interval, and the KV cache it held as each
    turn's answer began (`metrics["by_turn"]`)."""
    figure = Figure(figsize=(11, 4.2), dpi=110)
    quality, memory = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for axes in (quality, memory):
        axes.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)
        axes.grid(alpha=0.3)
        axes.set_xlabel("turn")
    runs = [(label, e) for label, members in lines.items() for e in members]
    if full is not None:
        runs.append(("full cache", full))
    for label, e in runs:
        rows = e.metrics["by_turn"]
        turns, scores = [r["turn"] for r in rows], [100 * r["score"] for r in rows]
        bars = [[s - 100 * r["ci_low"] for s, r in zip(scores, rows)], [100 * r["ci_high"] - s for s, r in zip(scores, rows)]]
        style = dict(color="gray", linestyle="--") if e is full else {}
        quality.errorbar(turns, scores, yerr=bars, marker="o", capsize=3, label=label, **style)
        memory.plot(turns, [100 * r["held_over_full"] for r in rows], marker="o", label=label, **style)
    quality.set_title(f"Quality by turn: {setting}", fontsize=10)
    quality.set_ylim(-3, 103)
    quality.set_ylabel("score (%)")
    memory.set_title("KV cache held as each answer began", fontsize=10)
    memory.set_ylabel("KV held (% of the full cache then)")
    for axes in (quality, memory):
        axes.xaxis.get_major_locator().set_params(integer=True)
    _save(figure, memory, path)


# ---- what each task's plots draw ----------------------------------------------------------------------------

_MEMORY = ("held_over_full", "bytes_held")  # what the memory plot needs of a run's metrics


def task_plots(entries: list, settings: list[str], output: Path) -> list[tuple[str, list[str]]]:
    """The PNGs of each setting (task @ length ...), written into `output`: (setting, file names) in order."""
    plots = []
    for number, setting in enumerate(settings, 1):
        group = [e for e in entries if e.setting == setting]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", setting).strip("-")[:60]
        full_run = next((e for e in group if e.is_full and "held_over_full" in e.metrics), None)
        figures = [("quality-vs-budget", quality_png, _lines(group), _full_score(group)),
                   ("memory-vs-quality", memory_png, _lines(group, _MEMORY), full_run)]
        if block_size_lines(group):
            figures.append(("quality-vs-block-size", block_size_png, block_size_lines(group), _full_score(group)))
        if any("by_turn" in e.metrics for e in group):
            full_turns = next((e for e in group if e.is_full and "by_turn" in e.metrics), None)
            figures.append(("quality-by-turn", turns_png, turn_lines(group), full_turns))
        pngs = []
        for name, draw, lines, reference in figures:
            png = output / f"{name}-{number}-{slug}.png"
            draw(lines, reference, setting, png)
            pngs.append(png.name)
        plots.append((setting, pngs))
    return plots



def _lines(group: list, needs: tuple[str, ...] = ()) -> Lines:
    """Entries of each non-full series that have the metrics `needs`, ordered by budget."""
    lines: Lines = {}
    for e in sorted(group, key=lambda e: (e.series, e.x)):
        if not e.is_full and all(isinstance(e.metrics.get(k), (int, float)) for k in needs):
            lines.setdefault(e.series, []).append(e)
    return lines


def turn_lines(group: list) -> Lines:
    """The multi-turn runs of a setting, a line each (series @ budget), by budget."""
    return {f"{e.series} @ {e.config['budget']}": [e] for e in sorted(group, key=lambda e: (e.series, e.x))
            if not e.is_full and "by_turn" in e.metrics}


def block_size_lines(group: list) -> Lines:
    """Runs that differ only in block size (same policy, budget and other ways of running), by block size:
    one line each where at least two block sizes were run."""
    others = [k for k in fields_where(report="variant") if k not in ("block_size", "granularity")
              and len({json.dumps(e.config.get(k), default=str) for e in group}) > 1]
    lines: Lines = {}
    for e in sorted(group, key=lambda e: e.config.get("block_size") or 0):
        if not e.is_full and is_number(e.config.get("block_size")):
            varied = ", ".join(f"{k}={as_text(e.config.get(k))}" for k in others)
            label = f"{policy_name(e.config)} @ {e.config['budget']}" + (f" ({varied})" if varied else "")
            lines.setdefault(label, []).append(e)
    return {label: members for label, members in lines.items()
            if len({e.config["block_size"] for e in members}) > 1}


def _full_score(group: list) -> float | None:
    fulls = [e for e in group if e.is_full]
    return fulls[0].metrics["score"] if fulls else None


_NAMED = {"head": ("per-head tokens", "C0"), "head_page": ("per-head pages", "C1"), "token": ("shared tokens", "C2"),
          "page": ("shared pages", "C3")}  # the headline's granularities: legend and colour, the same in every panel


def headline_png(views: dict[tuple, dict], path: Path) -> None:
    """The answer at a glance (`answer.headline`): a panel per model × length × mode, a line per granularity."""
    columns = min(4, len(views))
    rows = -(-len(views) // columns)
    figure = Figure(figsize=(3.6 * columns, 2.9 * rows + 0.6), dpi=110)
    for number, ((model, length, mode), view) in enumerate(views.items(), 1):
        axes = figure.add_subplot(rows, columns, number)
        for granularity, relative in view["lines"].items():
            axes.plot([float(b) for b in view["budgets"]], [100 * r for r in relative], marker="o",
                      color=_NAMED[granularity][1], label=granularity)
        axes.axhline(100, color="gray", linestyle="--", linewidth=0.8)
        axes.set_title(f"{model}, {length} tokens, {mode}\n{', '.join(view['scorers'])}", fontsize=8)
        axes.set_ylim(0, 110)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
    shown = {label: handle for axes in figure.axes for handle, label in zip(*axes.get_legend_handles_labels())}
    order = [g for g in _NAMED if g in shown]
    figure.legend([shown[g] for g in order], [_NAMED[g][0] for g in order], loc="upper center", ncol=4, fontsize=9,
                  frameon=False)
    figure.supxlabel("budget (fraction of the prompt kept)", fontsize=9)
    figure.supylabel("score / full cache (%), mean over the scorers named", fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.5 / figure.get_figheight()))
    figure.savefig(path)
