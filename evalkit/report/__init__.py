"""Reading the results store into pictures and verdicts: `evalkit report`, `evalkit compare`, `evalkit heatmap`.

command.py       the `evalkit report` and `evalkit compare` commands (each imports its module when it runs)
page.py          the leaderboard page (index.html from assets/): runs placed in settings and series, their plots
leaderboard.py   the leaderboard's numbers: quality AUC, one row per run, its display, leaderboard.csv
significance.py  each run against its baseline and its scorer's other granularities, paired, Holm-corrected
compare.py       two runs compared sample by sample (`evalkit compare`)
plots.py         plotly figures for the page, matplotlib PNG copies beside it
heatmap.py       niah heatmaps of several runs side by side
"""
