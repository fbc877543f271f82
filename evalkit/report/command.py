"""`evalkit report`: the command line over `evalkit.report.page`, which it imports when it runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    """Adds `evalkit report` to the command line."""
    app.command("report")(report)


def report(
    runs: Path = typer.Argument(Path("runs"), help="Results folder to read."),
    output: Path = typer.Option(Path("report"), "-o", "--output", help="Folder for index.html, PNGs and CSV."),
):
    """Leaderboard and plots (quality vs budget, memory vs quality, NIAH heatmaps) as one offline HTML page."""
    # The page reads run configs through evalkit.config (torch, transformers) and draws with matplotlib and
    # plotly: imported when `evalkit report` runs, so that the command line starts without them.
    from evalkit.report.page import build_report

    written = build_report(runs, output)
    console = Console(soft_wrap=True, highlight=False)
    console.print(f"report: {written.index}")
    console.print(f"{written.runs} runs, {written.plots} plots, {written.heatmaps} heatmaps; "
                  "leaderboard.csv and PNG copies of the plots beside it")
    for reason in written.skipped:
        console.print(f"left out: {reason}")
