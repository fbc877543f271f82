"""`evalkit bench`: speed and memory of the generation loop and of its pieces.

command.py      the CLI command: its options, then the checks and the measuring, imported when it runs
checks.py       the options parsed and checked before any measurement (`BenchGrid`)
grid.py         the grid measured cell by cell under a progress bar, kept in bench.json after every cell
report.py       bench.json's tables and plots (bench.png, components.png)
cells.py        what is measured: the settings every cell shares, one cell (`BenchCell`), the grid of cells
generations.py  whole generations (evalkit loop under a policy, HF generate as the baseline), one cell measured
targets.py      the measured rows against the full cache, and the issue's targets
components.py   one layer's pieces (prefill statistics, selection, decode attention), fitted exponents
isolation.py    a fresh process per measurement, device clocks, true peak memory
speed.py        --speed: the main job's speed against its baselines (its measurements)
speed_command.py  --speed, the command: options checked, speed.json and its table
"""
