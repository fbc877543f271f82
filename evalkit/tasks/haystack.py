"""RULER's haystacks, needles placed in them by depth, and fitting a haystack to the prompt tokens a length
leaves.

Follows NVIDIA/RULER scripts/data/synthetic/niah.py. The essay haystack is the
Paul Graham essays as a list of words: a prompt takes its first N words, and
needles go in at sentence boundaries a given percentage of the way through. The
noise haystack is one fixed line repeated N times; needles go in between lines.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Callable

from evalkit.assets import essays_dir
from evalkit.errors import EvalkitError

# A sentence ends at . ! or ?, perhaps closed by a quote or bracket, before a space and what can
# start a sentence. Simpler than RULER's nltk punkt (which needs a model download); where they
# differ, say after an abbreviation ("Mr. Smith"), a needle moves by a few words only.
_SENTENCE_BREAK = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))\s+(?=["'(\[]?[A-Z0-9])""")


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Words of the essays concatenated in file-name order (RULER's `haystack` list).

    These 49 essays are the first part of RULER's PaulGrahamEssays.json; RULER
    appends 169 more scraped from paulgraham.com, which no package ships.
    """
    files = sorted(essays_dir().glob("*.txt"))
    # No separator between files, as RULER's download script (and NIAH's loader) concatenates them.
    return tuple("".join(path.read_text(encoding="utf-8") for path in files).split())


def haystack_text(n_words: int) -> str:
    """The first `n_words` haystack words; like RULER, the haystack repeats when it is too short."""
    return " ".join(itertools.islice(itertools.cycle(essay_words()), n_words))


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's `noise` haystack line (niah.py, variable_tracking.py): a haystack of N is this line N times."""


def split_sentences(text: str) -> list[str]:
    return _SENTENCE_BREAK.split(text) if text else []


def insert_needles(text: str, needles: list[str], depths: list[float]) -> str:
    """`text` with `needles[i]` before sentence int(sentences × depths[i] / 100), as RULER places them."""
    return " ".join(insert_at_depths(split_sentences(text), needles, depths))


def insert_at_depths(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """A copy of `units` (sentences, lines) with `needles[i]` before unit int(len(units) × depths[i] / 100)."""
    units = list(units)
    count = len(units)
    # Deepest first, so that inserting never shifts a position still to be used.
    for depth, needle in sorted(zip(depths, needles), key=lambda pair: pair[0], reverse=True):
        units.insert(int(count * depth / 100), needle)
    return units


def first_guess(measure: Callable[[int], int], prompt_tokens: int, probe: int) -> int:
    """A starting size for `fit_size` when a size's token cost is unknown (lines, documents, words).

    Two probes, at 0 and at `probe`, give the fixed part of the prompt and the
    tokens one unit adds; the guess is the size a straight line puts at `prompt_tokens`.
    """
    fixed = measure(0)
    if fixed > prompt_tokens:
        raise EvalkitError(f"{prompt_tokens} prompt tokens leave no room for a haystack "
                           f"(the prompt without one takes {fixed})")
    per_unit = max(measure(probe) - fixed, 1) / probe
    return max(1, int((prompt_tokens - fixed) / per_unit))


def fit_size(measure: Callable[[int], int], prompt_tokens: int, guess: int) -> int:
    """A haystack size n with `measure(n) <= prompt_tokens` within 0.5% (at least 4 tokens) of it.

    `measure(n)` is the token count of the prompt built with n haystack words
    and must be non-decreasing in n. Each call tokenizes a whole prompt, so
    rather than bisect from scratch (RULER's way) each probe interpolates
    between the sizes known to fit and not to fit: token counts grow almost
    linearly in words, and two to four probes usually suffice (one when
    `guess`, say the previous sample's size, already fits). After a few
    probes it falls back to bisection, which always ends.
    """
    slack = max(4, prompt_tokens // 200)
    target = prompt_tokens - slack / 2
    fits, fits_tokens = 0, None  # largest size known to fit (0 is assumed to)
    too_big, too_big_tokens = None, None  # smallest size known not to fit
    size = max(guess, 1)
    for probe in itertools.count():
        tokens = measure(size)
        if tokens <= prompt_tokens:
            if prompt_tokens - tokens <= slack:
                return size
            fits, fits_tokens = size, tokens
        else:
            too_big, too_big_tokens = size, tokens
        if too_big is None:
            size = max(round(size * target / tokens), fits + 1)
            continue
        if too_big - fits <= 1:
            if fits == 0:
                raise EvalkitError(f"{prompt_tokens} prompt tokens leave no room for a haystack")
            return fits
        if fits_tokens is None:
            size = round(size * target / tokens)  # the prompt is mostly haystack: scale it
        elif probe < 4 and too_big_tokens > fits_tokens:
            size = round(fits + (target - fits_tokens) * (too_big - fits) / (too_big_tokens - fits_tokens))
        else:
            size = (fits + too_big) // 2
        size = min(max(size, fits + 1), too_big - 1)
