"""RULER's per-sample metrics (NVIDIA/RULER scripts/eval/synthetic/constants.py).

RULER scores a whole prediction file and reports mean × 100 rounded to two
decimals; here each function scores one prediction in [0, 1] and the runner
aggregates. Predictions are first cleaned as RULER's `postprocess_pred` does.
"""

from __future__ import annotations

import re
from typing import Callable

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, turn control characters into newlines, strip again."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def _hits(prediction: str, references: list[str]) -> list[float]:
    if not references:
        raise ValueError("a RULER metric needs at least one reference")
    text = postprocess(prediction).lower()
    return [float(reference.lower() in text) for reference in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references found in the prediction, ignoring case."""
    hits = _hits(prediction, references)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found in the prediction, ignoring case, else 0."""
    return max(_hits(prediction, references))


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}
