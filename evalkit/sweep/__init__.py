"""`evalkit sweep`: a grid of runs plus each full-cache baseline, resumable, in-process or on Ray.

plan.py     settings (defaults <- config file <- flags) into cells; the rows a finished sweep reports
engines.py  running the cells (local or Ray) and the sweep's W&B run
command.py  the CLI command
"""
