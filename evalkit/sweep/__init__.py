"""`evalkit sweep`: a grid of runs plus each full-cache baseline, resumable, in-process or on Ray.

plan.py     settings (defaults <- config file <- flags) into a `SweepPlan` of `SweepCell`s; the rows a finished
            sweep reports
engines.py  running the cells (local or Ray) and the sweep's W&B run
tables.py   what the command prints: the plan (--dry-run) and the score grid
command.py  the CLI command (the plan, engines and tables imported when it runs)
"""
