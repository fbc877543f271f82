"""Reading the results store into pictures: `evalkit report` and `evalkit heatmap`.

page.py     the leaderboard page (index.html from assets/), plots, leaderboard.csv; quality AUC
heatmap.py  niah heatmaps of several runs side by side
"""
