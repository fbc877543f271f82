"""`evalkit bench`: speed and memory of the generation loop and of its pieces.

command.py      the CLI command: grid, progress, bench.json, plots
generations.py  whole generations (evalkit loop under a policy, HF generate as the baseline), targets
components.py   one layer's pieces (prefill statistics, selection, decode attention), fitted exponents
isolation.py    a fresh process per measurement, device clocks, true peak memory
"""
