"""The report's plots: plotly figures for the page, matplotlib PNG copies beside it.

Each takes the lines to draw (label -> runs of `page.Entry`, in order along x) and the full-cache
reference (its score; for the memory plot its run), as `evalkit.report.page` chose them.
"""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib
import plotly.graph_objects as go
from matplotlib.figure import Figure

Lines = dict[str, list]  # label -> runs (evalkit.report.page.Entry), in order along the x axis


def block_size_plotly(lines: Lines, full: float | None, setting: str, div_id: str) -> str:
    figure = go.Figure()
    for label, members in lines.items():
        figure.add_trace(go.Scatter(
            x=[e.config["block_size"] for e in members], y=[100 * e.metrics["score"] for e in members],
            mode="lines+markers", name=_label(label), customdata=[[_label(e.run_id)] for e in members],
            hovertemplate="block size %{x}<br>score %{y:.1f}%<br>%{customdata[0]}<extra></extra>"))
    if full is not None:
        figure.add_hline(y=100 * full, line_dash="dash", line_color="gray", annotation_text="full cache")
    figure.update_layout(title=_label(f"Quality vs block size: {setting}"), xaxis_type="log",
                         xaxis_title="block size (tokens per page)", yaxis_title="score (%)", yaxis_range=[-3, 103],
                         template="plotly_white", height=420, showlegend=True)
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


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


def _label(text: str) -> str:
    """Plotly reads labels as a small subset of HTML; escape so names are shown, never interpreted."""
    return html.escape(text, quote=False)  # plotly decodes &lt; &gt; &amp; but shows &quot; as is


def _error_bars(members) -> list[list[float]]:
    """[below, above] in points: each run's 95 % interval around its score (0 where it has none)."""
    bars = [[], []]
    for e in members:
        interval, score = e.interval, 100 * e.metrics["score"]
        known = interval is not None and interval.ci_low is not None
        bars[0].append(score - 100 * interval.ci_low if known else 0.0)
        bars[1].append(100 * interval.ci_high - score if known else 0.0)
    return bars


def quality_plotly(lines: Lines, full: float | None, setting: str, div_id: str) -> str:
    figure = go.Figure()
    for series, members in lines.items():
        below, above = _error_bars(members)
        figure.add_trace(go.Scatter(
            x=[e.x for e in members], y=[100 * e.metrics["score"] for e in members], mode="lines+markers",
            name=_label(series), customdata=[[_label(e.run_id), e.config["budget"]] for e in members],
            error_y={"type": "data", "symmetric": False, "array": above, "arrayminus": below, "thickness": 1},
            hovertemplate="budget %{customdata[1]}<br>score %{y:.1f}%<br>%{customdata[0]}<extra></extra>"))
    if full is not None:
        figure.add_hline(y=100 * full, line_dash="dash", line_color="gray", annotation_text="full cache")
    figure.update_layout(title=_label(f"Quality vs budget: {setting}"),
                         xaxis_title="budget (fraction of the prompt kept)",
                         yaxis_title="score (%)", yaxis_range=[-3, 103], xaxis_range=[0, 1.02],
                         template="plotly_white", height=420, showlegend=True)
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


def memory_plotly(lines: Lines, full, setting: str, div_id: str) -> str:
    figure = go.Figure()
    for series, members in lines.items():
        members = sorted(members, key=lambda e: e.metrics["held_over_full"])
        figure.add_trace(go.Scatter(
            x=[100 * e.metrics["held_over_full"] for e in members], y=[100 * e.metrics["score"] for e in members],
            mode="lines+markers", name=_label(series),
            customdata=[[e.config["budget"], e.metrics["bytes_held"] / 2**20] for e in members],
            hovertemplate="budget %{customdata[0]}<br>KV held %{customdata[1]:.1f} MiB (%{x:.1f}% of full)"
                          "<br>score %{y:.1f}%<extra></extra>"))
    if full is not None:
        figure.add_trace(go.Scatter(x=[100 * full.metrics["held_over_full"]], y=[100 * full.metrics["score"]],
                                    mode="markers", name="full cache", marker={"symbol": "star", "size": 12,
                                                                               "color": "gray"}))
    figure.update_layout(title=_label(f"Memory vs quality: {setting}"),
                         xaxis_title="KV cache held (% of the full cache)",
                         yaxis_title="score (%)", yaxis_range=[-3, 103], template="plotly_white", height=420,
                         showlegend=True)
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


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
