"""RULER's synthetic tasks beyond needles (NVIDIA/RULER scripts/data/synthetic/), each a `FittedTask`
(`evalkit.tasks.ruler_fitted`). Registered by `evalkit.tasks.ruler`.

- `ruler:vt`: variable tracking (variable_tracking.py). Chains "VAR A = 12345",
  "VAR B = VAR A ", ... hide among noise lines; the answer is every variable
  of the first chain. A one-shot example (a smaller instance, fitted to 500
  tokens, with its answer) comes first.
- `ruler:cwe`: common words extraction (common_words_extraction.py). A
  numbered list of words in which ten appear more often; one worked example first.
- `ruler:fwe`: frequent words extraction (freq_words_extraction.py). Coded
  six-letter words with Zipf-distributed counts (alpha 2); the answer is the
  three most frequent after the top one, which is shown as "...".

Templates, lengths and departures from RULER: `evalkit.tasks.ruler`.
"""

from __future__ import annotations

import functools
import math
import random
import string
from dataclasses import dataclass

from evalkit.errors import EvalkitError
from evalkit.tasks.base import Sample
from evalkit.tasks.haystack import NOISE, first_guess, fit_size
from evalkit.tasks.ruler_fitted import SOURCE, FittedTask
from evalkit.tasks.ruler_niah import wonderwords_list


# --- variable tracking ------------------------------------------------------------------------

_VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
_VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
                     "{num_v} variables are assigned the value {query}, they are: ")


@dataclass(frozen=True)
class _Chains:
    names: tuple[tuple[str, ...], ...]  # per chain, its variables in assignment order
    values: tuple[str, ...]  # per chain, the value its first variable gets

    def lines(self) -> list[list[str]]:
        # RULER's lines, the trailing space of "VAR B = VAR A " included.
        return [[f"VAR {names[0]} = {value}", *(f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:]))]
                for names, value in zip(self.names, self.values)]


def _draw_chains(rng: random.Random, num_chains: int, length: int, letters: int, taken: set[str]) -> _Chains:
    """`num_chains` chains of `length` variables named by `letters` capitals, with five-digit values;
    names and values all distinct and not in `taken` (which grows by them)."""
    def fresh(make):
        while (item := make()) in taken:
            pass
        taken.add(item)
        return item

    names = tuple(tuple(fresh(lambda: "".join(rng.choices(string.ascii_uppercase, k=letters)))
                        for _ in range(length)) for _ in range(num_chains))
    values = tuple(fresh(lambda: str(rng.randint(10000, 99998))) for _ in range(num_chains))  # np.randint's range
    return _Chains(names, values)


def _noise_with_chains(size: int, chains: _Chains, layout_seed: int) -> str:
    """`size` noise lines with each chain's lines among them, in order, as RULER places them: a chain
    of k lines goes after k distinct noise-line positions drawn at random, one chain after the other."""
    rng = random.Random(layout_seed)
    lines = [NOISE] * size
    for chain in chains.lines():
        count = len(lines)
        # With fewer lines than the chain has, positions repeat (RULER needs at least as many).
        positions = sorted(rng.sample(range(count), len(chain)) if count >= len(chain)
                           else rng.choices(range(count + 1), k=len(chain)))
        for offset, (position, line) in enumerate(zip(positions, chain)):
            lines.insert(position + offset, line)
    return "\n".join(lines)


@dataclass(frozen=True)
class _VtSetup:
    icl_size: int  # noise lines of the one-shot example, fitted once per call as RULER does
    icl_layout_seed: int


@dataclass(frozen=True)
class _VtDraw:
    chains: _Chains
    icl_chains: _Chains
    layout_seed: int


class VariableTracking(FittedTask):
    """RULER vt: the variables assigned a value through chains of assignments hidden in noise.

    As RULER: the one-shot example is one instance (three-letter names, at most
    ten hops) fitted once to `icl_length` tokens, then per sample given new names
    and a new value (RULER's `randomize_icl`); it precedes the task as
    "<example><answer prefix> <names>\\n" and a newline. A sample's `meta` holds
    the value asked for and both haystack sizes in lines.
    """

    name = "ruler:vt"
    description = "RULER vt: name every variable a 5-hop assignment chain hidden in noise gives a value"
    source = SOURCE.format(script="variable_tracking.py")
    max_new_tokens = 30
    num_chains = 1  # synthetic.yaml
    num_hops = 4
    icl_length = 500  # RULER fits its example to 500 tokens (answer and tokens to generate not counted)

    def _setup(self, prompt_length, length, n, rng):
        chains = _draw_chains(rng, self.num_chains, min(10, self.num_hops) + 1, 3, set())
        layout_seed = rng.getrandbits(64)

        def measure(size: int) -> int:
            noise = _noise_with_chains(size, chains, layout_seed)
            return prompt_length(Sample("icl", _VT_INSTRUCTION + noise, *self._ask(chains), [], 0))

        size = fit_size(measure, self.icl_length, first_guess(measure, self.icl_length, self.probe))
        return _VtSetup(size, layout_seed)

    def _draw(self, setup, rng, index):
        taken = set()
        chains = _draw_chains(rng, self.num_chains, self.num_hops + 1, 5, taken)
        icl_chains = _draw_chains(rng, self.num_chains, min(10, self.num_hops) + 1, 3, taken | {"VAR"})
        return _VtDraw(chains, icl_chains, rng.getrandbits(64))

    def _build(self, setup, index, draw, size):
        icl = draw.icl_chains
        example = (_VT_INSTRUCTION + _noise_with_chains(setup.icl_size, icl, setup.icl_layout_seed) + "\n"
                   + "".join(self._ask(icl)) + " " + " ".join(icl.names[0]) + "\n")
        question, answer_prefix = self._ask(draw.chains)
        return Sample(
            id=self._id(index),
            context=example + "\n" + _VT_INSTRUCTION + _noise_with_chains(size, draw.chains, draw.layout_seed),
            question=question,
            answer_prefix=answer_prefix,
            references=list(draw.chains.names[0]),
            max_new_tokens=self.max_new_tokens,
            meta={"value": draw.chains.values[0], "haystack_lines": size, "icl_haystack_lines": setup.icl_size},
        )

    @staticmethod
    def _ask(chains: _Chains) -> tuple[str, str]:
        value = chains.values[0]
        return (_VT_QUESTION.format(query=value),
                _VT_ANSWER_PREFIX.format(num_v=len(chains.names[0]), query=value))


# --- common words extraction ------------------------------------------------------------------

_CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n")
_CWE_QUESTION = "Question: What are the {num_cw} most common words in the above list?"
_CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"


@functools.lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """RULER's cwe vocabulary: wonderwords' nouns, adjectives and verbs, deduplicated and sorted."""
    return tuple(sorted(set().union(*(wonderwords_list(f"{kind}list.txt") for kind in ("noun", "adjective", "verb")))))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass(frozen=True)
class _CweSetup:
    example_words: int  # distinct words of the worked example
    example_freq: tuple[int, int]  # (common, uncommon) repeats in the example
    freq: tuple[int, int]  # (common, uncommon) repeats in the task


@dataclass(frozen=True)
class _CweDraw:
    example: str  # the worked example with its answer
    words: tuple[str, ...]  # every word in a random order: the first num_cw are the common ones
    shuffle_seed: int


class CommonWordsExtraction(FittedTask):
    """RULER cwe: the ten words repeated most in a long numbered list.

    RULER's settings depend on the length: under 4096 tokens the ten common
    words appear 6 times and the others once (a 20-word example with 3 and 1
    repeats); from 4096 on, synthetic.yaml's freq_cw 30 and freq_ucw 3 (a 40-word
    example with 10 and 3). The haystack size is the number of uncommon words.
    The example draws its words independently of the task, as RULER's does. A
    sample's `meta` holds the number of distinct words and the repeats.
    """

    name = "ruler:cwe"
    description = "RULER cwe: name the 10 words repeated most often in a long numbered word list"
    source = SOURCE.format(script="common_words_extraction.py") + "; wonderwords word lists"
    max_new_tokens = 120
    freq_cw, freq_ucw, num_cw = 30, 3, 10  # synthetic.yaml
    num_fewshot = 1
    short_length = 4096  # below it, RULER's fixed short settings
    probe = 16

    def _setup(self, prompt_length, length, n, rng):
        if length < self.short_length:
            return _CweSetup(example_words=20, example_freq=(3, 1), freq=(6, 1))
        return _CweSetup(example_words=40, example_freq=(10, 3), freq=(self.freq_cw, self.freq_ucw))

    def _draw(self, setup, rng, index):
        vocabulary = cwe_words()
        examples = []
        for _ in range(self.num_fewshot):
            words = rng.sample(vocabulary, setup.example_words)
            listed = self._list(words, setup.example_freq, rng)
            question, answer_prefix = self._ask()
            examples.append(_CWE_INSTRUCTION + listed + "\n" + question + answer_prefix + " "
                            + _numbered(words[:self.num_cw]))
        return _CweDraw("\n".join(examples), tuple(rng.sample(vocabulary, len(vocabulary))), rng.getrandbits(64))

    def _build(self, setup, index, draw, size):
        distinct = self.num_cw + size
        if distinct > len(draw.words):
            raise EvalkitError(f"cwe at this length needs {distinct} distinct words and wonderwords has "
                               f"{len(draw.words)} (RULER then takes a list no package ships): lower the length")
        words = list(draw.words[:distinct])
        question, answer_prefix = self._ask()
        return Sample(
            id=self._id(index),
            context=draw.example + "\n" + _CWE_INSTRUCTION
            + self._list(words, setup.freq, random.Random(draw.shuffle_seed)),
            question=question,
            answer_prefix=answer_prefix,
            references=words[:self.num_cw],
            max_new_tokens=self.max_new_tokens,
            meta={"haystack_words": distinct, "freq_cw": setup.freq[0], "freq_ucw": setup.freq[1]},
        )

    def _list(self, words: list[str], freq: tuple[int, int], rng: random.Random) -> str:
        repeated = words[:self.num_cw] * freq[0] + words[self.num_cw:] * freq[1]
        rng.shuffle(repeated)
        return _numbered(repeated)

    def _ask(self) -> tuple[str, str]:
        return _CWE_QUESTION.format(num_cw=self.num_cw), _CWE_ANSWER_PREFIX.format(num_cw=self.num_cw)


# --- frequent words extraction ----------------------------------------------------------------

_FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. "
                    "Find the three most frequently appeared coded words. ")
_FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                 "What are the three most frequently appeared words in the above coded text?")
_FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def zeta(alpha: float) -> float:
    """Riemann zeta at alpha > 1 (scipy.special.zeta, which RULER calls), by Euler-Maclaurin summation."""
    if alpha <= 1:
        raise ValueError("zeta needs alpha > 1")
    n = 64
    head = math.fsum(k ** -alpha for k in range(1, n))
    # The tail from n on: integral, half the first term, and two Bernoulli corrections (error ~ n^-(alpha+5)).
    tail = (n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2 + alpha * n ** (-alpha - 1) / 12
            - alpha * (alpha + 1) * (alpha + 2) * n ** (-alpha - 3) / 720)
    return head + tail


@dataclass(frozen=True)
class _FweDraw:
    vocabulary: tuple[str, ...]  # by rank: "..." first, then the answers
    shuffle_seed: int


class FrequentWordsExtraction(FittedTask):
    """RULER fwe: the three most frequent coded words of a text whose word counts follow Zipf's law.

    As RULER: the vocabulary is (length - tokens to generate) // 50 random
    six-letter words; the word of rank k appears int(N k^-alpha / zeta(alpha))
    times, N being the haystack size (RULER's num_words), and the rank-1 word is
    replaced by "...", the noise the question says to ignore. A sample's `meta`
    holds N, the number of coded words written, and the vocabulary size.
    """

    name = "ruler:fwe"
    description = "RULER fwe: name the 3 most frequent words of a Zipf-distributed coded text"
    source = SOURCE.format(script="freq_words_extraction.py")
    max_new_tokens = 50
    alpha = 2.0  # synthetic.yaml
    coded_wordlen = 6
    probe = 64

    def _setup(self, prompt_length, length, n, rng):
        vocab_size = (length - self.max_new_tokens) // 50
        if vocab_size < 4:
            raise EvalkitError(f"fwe needs a vocabulary of at least 4 words; length {length} gives {vocab_size}")
        return vocab_size

    def _draw(self, setup, rng, index):
        vocabulary = {}  # a dict keeps the order drawn, which is as random as RULER's shuffled sort
        while len(vocabulary) < setup:
            vocabulary["".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen))] = None
        return _FweDraw(("...", *list(vocabulary)[1:]), rng.getrandbits(64))

    def counts(self, size: int, vocab_size: int) -> list[int]:
        """Occurrences of each rank's word when the haystack size is `size` (RULER's `gen_text`)."""
        z = zeta(self.alpha)
        return [int(size * k ** -self.alpha / z) for k in range(1, vocab_size + 1)]

    def _build(self, setup, index, draw, size):
        counts = self.counts(size, len(draw.vocabulary))
        words = [word for word, count in zip(draw.vocabulary, counts) for _ in range(count)]
        random.Random(draw.shuffle_seed).shuffle(words)
        return Sample(
            id=self._id(index),
            context=_FWE_INSTRUCTION + " ".join(words),
            question=_FWE_QUESTION,
            answer_prefix=_FWE_ANSWER_PREFIX,
            references=list(draw.vocabulary[1:4]),
            max_new_tokens=self.max_new_tokens,
            meta={"num_words": size, "coded_words": len(words), "vocab_size": len(draw.vocabulary)},
        )
