"""The settings every method of `evalkit.uncertainty` shares: the confidence of its intervals, the level and
power of its tests, and the resamples and seed of whatever it draws at random (bootstrap resamples, random
swaps of the permutation test), so that the same records always give the same numbers."""

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
ALPHA = 0.05  # of the paired tests, and of `samples_needed`
POWER = 0.8  # of `samples_needed`
