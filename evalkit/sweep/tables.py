"""What `evalkit sweep` prints: the plan with each cell's state (--dry-run), and the score grid after a run."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from evalkit.errors import EvalkitError
from evalkit.results import RunDir
from evalkit.sweep.plan import SweepCell, SweepPlan, prefill_notes, sweep_rows
from evalkit.uncertainty import compare, samples_needed


def _samples_done(plan: SweepPlan, cell: SweepCell) -> int | None:
    """The samples a cell has written: all of them when it is done, None when it has not begun."""
    run_dir = RunDir(plan.out, cell.run_id)
    if run_dir.complete:
        return cell.config.samples
    return len(run_dir.predictions()) if run_dir.predictions_path.exists() else None


def _stage(cell: SweepCell, done: int | None) -> str:
    if done is None:
        return "to run"
    return "done" if done >= cell.config.samples else "partial"


def _state(cell: SweepCell, done: int | None) -> str:
    stage = _stage(cell, done)
    return f"partial ({done} samples)" if stage == "partial" else stage


def progress_line(plan: SweepPlan, done: dict[str, int | None]) -> str:
    """How far the grid is: cells by state, and the cell-samples left of all it plans (a long grid's size)."""
    stages = Counter(_stage(cell, done[cell.run_id]) for cell in plan.cells)
    total = sum(cell.config.samples for cell in plan.cells)
    left = sum(cell.config.samples - min(done[cell.run_id] or 0, cell.config.samples) for cell in plan.cells)
    return (f"{len(plan.cells)} cells: {stages['done']} done, {stages['partial']} partial, "
            f"{stages['to run']} to run; {left:,} of {total:,} cell-samples left")


def print_plan(plan: SweepPlan, console: Console, detect: float | None = None) -> None:
    """Every cell: its run id, task, length, policy, budget, how it is prefilled and what is done; with `detect`
    (points), the samples it needs to detect that difference from its full cache (`samples_needed`)."""
    table = Table(title=f"{plan.sweep_id}: {len(plan.cells)} cells", title_justify="left")
    table.add_column("run id")
    for column in ("task", "length", "policy", "budget", "prefill", "state"):
        table.add_column(column)
    if detect is not None:
        table.add_column(f"samples for {detect:g} points", justify="right")
    notes = prefill_notes(plan)
    done = {cell.run_id: _samples_done(plan, cell) for cell in plan.cells}
    for cell in plan.cells:
        c = cell.config
        needed = [] if detect is None else [_samples_needed(plan, cell, detect / 100)]
        table.add_row(cell.run_id, c.task, str(c.length), cell.policy + (" (baseline)" if cell.baseline else ""),
                      str(c.budget), notes[cell.run_id], _state(cell, done[cell.run_id]), *needed)
    wide = Console(file=console.file, width=10_000)
    wide.width = max(console.width, wide.measure(table).maximum)  # run ids are long: never cut a line
    wide.print(table)
    console.print(progress_line(plan, done))


def _samples_needed(plan: SweepPlan, cell: SweepCell, detect: float) -> str:
    """At the disagreement with its full cache observed so far (both runs complete), else at the conservative
    default (docs/statistics.md)."""
    if cell.baseline:
        return "-"
    own, base = RunDir(plan.out, cell.run_id), RunDir(plan.out, cell.config.full_cache().run_id())
    needed = None
    if own.complete and base.complete:
        try:
            needed = compare(own.predictions(), base.predictions(), detect).needed
        except EvalkitError:  # not the same samples, or fewer than two: nothing observed to go on
            pass
    return str(needed) if needed else f"{samples_needed(detect)} (default)"


def print_scores(plan: SweepPlan, console: Console) -> None:
    """Score per policy (rows) and budget (columns), one table per task and length."""
    rows = sweep_rows(plan)
    for task in plan.settings["tasks"]:
        for length in plan.settings["lengths"]:
            here = [r for r in rows if r["task"] == task and r["length"] == length]
            if not here:
                continue
            full = here[0]["full_cache_score"]
            console.print(f"[bold]{task} @ {length}[/]: score %, full cache "
                          + (f"{100 * full:.1f}" if full is not None else "not run"), highlight=False)
            table = Table()
            table.add_column("policy")
            budgets = list(dict.fromkeys(r["budget"] for r in here))
            for budget in budgets:
                table.add_column(str(budget), justify="right")
            for policy in dict.fromkeys(r["policy"] for r in here):
                by_budget = {r["budget"]: r["score"] for r in here if r["policy"] == policy}
                table.add_row(policy, *(f"{100 * by_budget[b]:.1f}" if b in by_budget else "" for b in budgets))
            console.print(table)
    console.print(f"results: {plan.out}  (report: evalkit report {plan.out})")
