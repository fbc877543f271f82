"""`evalkit report` and `evalkit compare`: the command line over `evalkit.report.page` and
`evalkit.report.compare`, each imported when its command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    """Adds `evalkit report` and `evalkit compare` to the command line."""
    app.command("report")(report)
    app.command("compare")(compare)


def report(
    runs: list[Path] = typer.Argument(
        [Path("runs")], help="Results folders, read together (a run id in several is shown from the first)."),
    output: str = typer.Option("report", "-o", "--output", help="Folder for index.html, PNGs and CSV."),
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


def compare(
    a: str = typer.Argument(..., help="A run: its folder, or its run id under --runs."),
    b: Optional[str] = typer.Argument(None, help="The other run (or --baseline)."),
    baseline: bool = typer.Option(False, "--baseline", help="Compare A with its full-cache baseline."),
    runs: Path = typer.Option(Path("runs"), help="Results folder that run ids are looked up in."),
    detect: float = typer.Option(10.0, help="Points of difference the sample count should detect (0-100)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
):
    """Two runs on the same samples, paired: the difference with its interval, the p-value (exact McNemar for
    pass/fail scores, paired permutation test otherwise), samples only one did better on, and a verdict."""
    # scipy and evalkit.config (torch): imported when `evalkit compare` runs.
    from evalkit.report.compare import compare_runs

    compare_runs(a, b, baseline, runs, detect, as_json)
