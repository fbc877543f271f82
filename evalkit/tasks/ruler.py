"""RULER beyond needles (NVIDIA/RULER scripts/data/synthetic/), and `ruler`, all thirteen tasks at once.

- `ruler:vt`: variable tracking (variable_tracking.py). Chains "VAR A = 12345",
  "VAR B = VAR A ", ... hide among noise lines; the answer is every variable
  of the first chain. A one-shot example (a smaller instance, fitted to 500
  tokens, with its answer) comes first.
- `ruler:cwe`: common words extraction (common_words_extraction.py). A
  numbered list of words in which ten appear more often; one worked example first.
- `ruler:fwe`: frequent words extraction (freq_words_extraction.py). Coded
  six-letter words with Zipf-distributed counts (alpha 2); the answer is the
  three most frequent after the top one, which is shown as "...".
- `ruler:qa_1` (SQuAD v2 dev) and `ruler:qa_2` (HotpotQA dev, distractor
  setting) (qa.py): the paragraphs holding the answer among distractor paragraphs.

Templates, answer prefixes and tokens to generate are RULER's
scripts/data/synthetic/constants.py; metrics are scripts/eval/synthetic/constants.py
(string_match_all, string_match_part for qa); settings are scripts/synthetic.yaml.
Each template is cut where the Sample fields meet, so that the runner's
`context + "\\n" + question + answer_prefix` is RULER's prompt with its `base`
model template (the answer prefix goes after the assistant turn opens, where
RULER puts it for chat templates too).

Lengths: like RULER, each task fits a haystack size (noise lines, distinct
words, coded words, documents) to the largest with prompt + tokens to generate
within the length; here with the evaluated model's tokenizer through the
`prompt_length` callback and per sample. A size unit can hold many tokens (a
QA document, some hundred), so a prompt lands up to one unit under its budget.

Where this departs from RULER, besides what the classes say: samples draw from
a `random.Random(seed)` of their own instead of the global generators, so no
sample equals RULER's own files; QA questions are drawn at random (RULER takes
the first n in file order, whatever the seed); variable names within a sample,
values and coded words are always distinct (RULER does not check).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import string
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks.haystack import NOISE, first_guess, fit_size
from evalkit.tasks.metrics import METRICS
from evalkit.tasks.ruler_niah import NIAH_TASKS, wonderwords_list

_SOURCE = "NVIDIA/RULER scripts/data/synthetic/{script}, constants.py and scripts/synthetic.yaml"


class _FittedTask(Task):
    """A RULER task whose sample is a draw (what is hidden and asked) around a haystack of fitted size.

    Subclasses say what a whole call shares (`_setup`), what each sample draws
    (`_draw`, from the call's generator, in sample order) and how a sample is
    built from its draw and a haystack size (`_build`, a pure function of its
    arguments, so that the size fitted is the size returned).
    """

    metric = "string_match_all"
    max_new_tokens: ClassVar[int]
    probe: ClassVar[int] = 8  # haystack units of the second probe of `first_guess`

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        budget = length - self.max_new_tokens
        if budget <= 0:
            raise EvalkitError(f"length {length} leaves no room for a prompt ({self.max_new_tokens} new tokens)")
        rng = random.Random(seed)
        setup = self._setup(prompt_length, length, n, rng)
        size, samples = None, []
        for index in range(n):
            build = functools.partial(self._build, setup, index, self._draw(setup, rng, index))

            def measure(size: int) -> int:
                return prompt_length(build(size))

            if size is None:  # later samples start from the previous fit
                size = first_guess(measure, budget, self.probe)
            size = fit_size(measure, budget, size)
            samples.append(build(size))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        return METRICS[self.metric](prediction, references)

    def _setup(self, prompt_length: PromptLength, length: int, n: int, rng: random.Random) -> Any:
        return None

    @abstractmethod
    def _draw(self, setup: Any, rng: random.Random, index: int) -> Any: ...

    @abstractmethod
    def _build(self, setup: Any, index: int, draw: Any, size: int) -> Sample: ...

    def _id(self, index: int) -> str:
        return f"{self.name.removeprefix('ruler:')}-{index:04d}"


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


class VariableTracking(_FittedTask):
    """RULER vt: the variables assigned a value through chains of assignments hidden in noise.

    As RULER: the one-shot example is one instance (three-letter names, at most
    ten hops) fitted once to `icl_length` tokens, then per sample given new names
    and a new value (RULER's `randomize_icl`); it precedes the task as
    "<example><answer prefix> <names>\\n" and a newline. A sample's `meta` holds
    the value asked for and both haystack sizes in lines.
    """

    name = "ruler:vt"
    description = "RULER vt: name every variable a 5-hop assignment chain hidden in noise gives a value"
    source = _SOURCE.format(script="variable_tracking.py")
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


class CommonWordsExtraction(_FittedTask):
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
    source = _SOURCE.format(script="common_words_extraction.py") + "; wonderwords word lists"
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


class FrequentWordsExtraction(_FittedTask):
    """RULER fwe: the three most frequent coded words of a text whose word counts follow Zipf's law.

    As RULER: the vocabulary is (length - tokens to generate) // 50 random
    six-letter words; the word of rank k appears int(N k^-alpha / zeta(alpha))
    times, N being the haystack size (RULER's num_words), and the rank-1 word is
    replaced by "...", the noise the question says to ignore. A sample's `meta`
    holds N, the number of coded words written, and the vocabulary size.
    """

    name = "ruler:fwe"
    description = "RULER fwe: name the 3 most frequent words of a Zipf-distributed coded text"
    source = _SOURCE.format(script="freq_words_extraction.py")
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


# --- question answering -----------------------------------------------------------------------

_QA_HEAD = ("Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nThe following are given documents.\n\n")
# RULER has "\n\n" after the documents; the runner's "\n" is one of them, so the question starts with the other.
_QA_QUESTION = ("\nAnswer the question based on the given documents. Only give me the answer and do not output "
                "any other words.\n\nQuestion: {query}")
_QA_ANSWER_PREFIX = " Answer:"
_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class QaItem:
    query: str
    outputs: tuple[str, ...]  # the accepted answers
    gold: tuple[int, ...]  # documents given with the question: SQuAD its paragraph, HotpotQA all ten
    more: tuple[int, ...] = ()  # SQuAD: the other paragraphs of its article, RULER's first distractors


@dataclass(frozen=True)
class QaData:
    items: tuple[QaItem, ...]
    docs: tuple[str, ...]  # sorted and distinct, as RULER indexes them


def parse_squad(data: dict) -> QaData:
    """RULER's `read_squad` of SQuAD v2 dev (dev-v2.0.json): answerable questions only."""
    docs = sorted({paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]})
    index = {doc: i for i, doc in enumerate(docs)}
    items = []
    for article in data["data"]:
        article_docs = [index[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:
                    items.append(QaItem(qa["question"], tuple(a["text"] for a in qa["answers"]), (own,),
                                        tuple(i for i in article_docs if i != own)))
    return QaData(tuple(items), tuple(docs))


def parse_hotpotqa(data: list) -> QaData:
    """RULER's `read_hotpotqa` of HotpotQA dev, distractor setting (hotpot_dev_distractor_v1.json)."""
    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({doc(title, sentences) for record in data for title, sentences in record["context"]})
    index = {text: i for i, text in enumerate(docs)}
    items = tuple(QaItem(record["question"], (record["answer"],),
                         tuple(index[doc(title, sentences)] for title, sentences in record["context"]))
                  for record in data)
    return QaData(items, tuple(docs))


def _squad_from_hub(rows) -> dict:
    """The hub's flat squad_v2 rows (title, context, question, answers) regrouped as dev-v2.0.json."""
    articles: dict[str, dict[str, list]] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], {})
        paragraphs.setdefault(row["context"], []).append(
            {"question": row["question"], "answers": [{"text": text} for text in row["answers"]["text"]],
             "is_impossible": not row["answers"]["text"]})
    return {"data": [{"title": title, "paragraphs": [{"context": context, "qas": qas}
                                                     for context, qas in paragraphs.items()]}
                     for title, paragraphs in articles.items()]}


def _hotpotqa_from_hub(rows) -> list:
    """The hub's hotpot_qa rows (context as {title: [...], sentences: [[...]]}) as the dev JSON's records."""
    return [{"question": row["question"], "answer": row["answer"],
             "context": [list(pair) for pair in zip(row["context"]["title"], row["context"]["sentences"])]}
            for row in rows]


@dataclass(frozen=True)
class _QaSource:
    env: str  # environment variable naming a local file
    file: str  # the file RULER downloads (scripts/data/synthetic/json/download_qa_dataset.sh)
    hub: tuple[str, str | None]  # dataset and configuration on the Hugging Face hub, split "validation"
    parse: Any
    from_hub: Any


QA_SOURCES = {
    "squad": _QaSource("EVALKIT_RULER_SQUAD", "SQuAD v2 dev-v2.0.json", ("rajpurkar/squad_v2", None),
                       parse_squad, _squad_from_hub),
    "hotpotqa": _QaSource("EVALKIT_RULER_HOTPOTQA", "HotpotQA hotpot_dev_distractor_v1.json",
                          ("hotpotqa/hotpot_qa", "distractor"), parse_hotpotqa, _hotpotqa_from_hub),
}


def hub_off() -> str | None:
    """The environment variable that turns the hub off, if one does (huggingface_hub's reading of it)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return variable
    return None


def qa_unavailable(dataset: str, path: str | os.PathLike | None = None) -> str | None:
    """Why `load_qa` would surely fail, found without loading anything; None if it may work."""
    source = QA_SOURCES[dataset]
    path = path or os.environ.get(source.env)
    if path:
        return None if Path(path).is_file() else f"no file {path}"
    off = hub_off()
    return f"no local {source.file} (set {source.env}) and the hub is off ({off} is set)" if off else None


def load_qa(dataset: str, path: str | os.PathLike | None = None) -> QaData:
    """RULER's QA data: from `path`, else from the file named by the source's environment variable,
    else from the hub unless it is off; an EvalkitError says why when none works."""
    source = QA_SOURCES[dataset]
    path = path or os.environ.get(source.env)
    if path:
        resolved = Path(path).resolve()
        if not resolved.is_file():
            raise EvalkitError(f"RULER {dataset}: no file {path} (expected {source.file})")
        return _read_local(dataset, str(resolved), resolved.stat().st_mtime_ns)
    if off := hub_off():
        raise EvalkitError(f"RULER {dataset}: no local data and the hub is off ({off} is set); set "
                           f"{source.env} to {source.file} as RULER downloads it")
    return _read_hub(dataset)


@functools.lru_cache(maxsize=4)
def _read_local(dataset: str, path: str, mtime_ns: int) -> QaData:
    source = QA_SOURCES[dataset]
    try:
        with open(path, encoding="utf-8") as file:
            parsed = source.parse(json.load(file))
    except json.JSONDecodeError as error:
        raise EvalkitError(f"{path}: not JSON ({error.msg})") from None
    except (KeyError, TypeError, ValueError) as error:
        raise EvalkitError(f"{path}: not in the format of {source.file} ({type(error).__name__}: {error})") from None
    if not parsed.items:
        raise EvalkitError(f"{path}: no answerable question")
    return parsed


@functools.lru_cache(maxsize=2)
def _read_hub(dataset: str) -> QaData:
    source = QA_SOURCES[dataset]
    name, config = source.hub
    try:
        import datasets

        rows = datasets.load_dataset(name, config, split="validation")
        return source.parse(source.from_hub(rows))
    except Exception as error:  # any failure to fetch is the user's environment: one line, not a traceback
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise EvalkitError(f"RULER {dataset}: cannot load {name} from the hub ({reason}); "
                           f"set {source.env} to {source.file} instead") from None


@dataclass(frozen=True)
class _QaDraw:
    item: QaItem
    distractors: tuple[int, ...]  # in the order they join: same-article paragraphs first, then any other
    shuffle_seed: int


class QaTask(_FittedTask):
    """RULER qa: a question over its paragraph(s) among distractor paragraphs, "Document i:" each.

    The haystack size is the number of distractors: RULER takes the same
    article's other paragraphs first (SQuAD), then paragraphs of other questions,
    and shuffles them with the question's own. Data: the constructor's
    `data_path`, else the file named by $EVALKIT_RULER_SQUAD or
    $EVALKIT_RULER_HOTPOTQA (RULER's downloaded JSON), else the hub
    (rajpurkar/squad_v2; hotpotqa/hotpot_qa, distractor) unless it is off.
    A sample's `meta` holds the documents given and where the first gold one is.
    """

    dataset: ClassVar[str]
    metric = "string_match_part"
    max_new_tokens = 32
    probe = 4

    def __init__(self, data_path: str | os.PathLike | None = None):
        self.data_path = data_path

    def data(self) -> QaData:
        return load_qa(self.dataset, self.data_path)

    def unavailable(self) -> str | None:
        return qa_unavailable(self.dataset, self.data_path)

    def _setup(self, prompt_length, length, n, rng):
        data = self.data()
        if n > len(data.items):
            raise EvalkitError(f"{self.name} has {len(data.items)} answerable questions; {n} asked for")
        return data, rng.sample(range(len(data.items)), n)

    def _draw(self, setup, rng, index):
        data, picks = setup
        item = data.items[picks[index]]
        taken = {*item.gold, *item.more}
        others = [doc for doc in rng.sample(range(len(data.docs)), len(data.docs)) if doc not in taken]
        return _QaDraw(item, (*rng.sample(item.more, len(item.more)), *others), rng.getrandbits(64))

    def _build(self, setup, index, draw, size):
        data, _ = setup
        if size > len(draw.distractors):
            raise EvalkitError(f"{self.name}: {size} distractor documents needed and the data has "
                               f"{len(draw.distractors)}: lower the length")
        docs = [*draw.item.gold, *draw.distractors[:size]]
        random.Random(draw.shuffle_seed).shuffle(docs)
        gold = set(draw.item.gold)
        return Sample(
            id=self._id(index),
            context=_QA_HEAD + "\n\n".join(_DOCUMENT.format(i=i + 1, document=data.docs[doc])
                                           for i, doc in enumerate(docs)),
            question=_QA_QUESTION.format(query=draw.item.query),
            answer_prefix=_QA_ANSWER_PREFIX,
            references=list(draw.item.outputs),
            max_new_tokens=self.max_new_tokens,
            meta={"documents": len(docs), "gold_documents": [i + 1 for i, doc in enumerate(docs) if doc in gold]},
        )


class Qa1(QaTask):
    name = "ruler:qa_1"
    description = "RULER qa_1: answer a SQuAD v2 question from its paragraph hidden among distractor paragraphs"
    source = _SOURCE.format(script="qa.py") + "; SQuAD v2 dev"
    dataset = "squad"


class Qa2(QaTask):
    name = "ruler:qa_2"
    description = "RULER qa_2: answer a HotpotQA multi-hop question from paragraphs among distractor paragraphs"
    source = _SOURCE.format(script="qa.py") + "; HotpotQA dev (distractor)"
    dataset = "hotpotqa"


# --- the group --------------------------------------------------------------------------------

OTHER_TASKS: tuple[type[Task], ...] = (VariableTracking, CommonWordsExtraction, FrequentWordsExtraction, Qa1, Qa2)
RULER_TASKS = tuple(task.name.removeprefix("ruler:") for task in (*NIAH_TASKS, *OTHER_TASKS))
"""RULER's thirteen tasks in scripts/synthetic.yaml order."""


class Ruler(Task):
    """All of RULER: n samples of each task at the same length and seed, each sample's `meta["task"]`
    naming its task (the runner reports per-task means and their mean, as RULER averages tasks).

    Scoring dispatches to the task's own metric: by `meta["task"]` when given,
    else by the references, remembered for every sample this instance made.
    The QA tasks are left out, and the description says so, when their data is
    unavailable (no local file and the hub off, or a failed load); `skipped`
    holds why.
    """

    name = "ruler"
    source = "NVIDIA/RULER scripts/synthetic.yaml: its 13 tasks, each as ruler:<name>"
    metric = "string_match_all; string_match_part for qa_1, qa_2"

    def __init__(self, qa_paths: dict[str, str | os.PathLike] | None = None):
        qa_paths = qa_paths or {}
        self.tasks: dict[str, Task] = {}
        for task in (*NIAH_TASKS, *OTHER_TASKS):
            short = task.name.removeprefix("ruler:")
            self.tasks[short] = task(qa_paths.get(short)) if issubclass(task, QaTask) else task()
        self.skipped: dict[str, str] = {short: reason for short, task in self.tasks.items()
                                        if isinstance(task, QaTask) and (reason := task.unavailable())}
        self._task_of: dict[tuple[str, ...], str] = {}

    @property
    def description(self) -> str:
        text = "RULER: all 13 tasks, n samples each, scored as the mean of the task means"
        if self.skipped:  # the reasons in full are in `skipped`
            text += "; skipped for want of data: " + ", ".join(
                f"{short} (set {QA_SOURCES[self.tasks[short].dataset].env})" for short in self.skipped)
        return text

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        samples = []
        for short, task in self.tasks.items():
            if short in self.skipped:
                continue
            if isinstance(task, QaTask):
                try:
                    task.data()
                except EvalkitError as error:  # unavailable data skips the task; anything else is raised
                    self.skipped[short] = str(error)
                    continue
            for sample in task.samples(prompt_length, length, n, seed):
                self._task_of[tuple(sample.references)] = short
                samples.append(dataclasses.replace(sample, meta={**sample.meta, "task": short}))
        return samples

    def score(self, prediction: str, references: list[str], meta: dict | None = None) -> float:
        short = meta["task"] if meta and "task" in meta else self._task_of.get(tuple(references))
        if short not in self.tasks:
            raise ValueError("the ruler group scores a sample by its meta['task'] or by references it made; "
                             f"got neither ({references!r})")
        return self.tasks[short].score(prediction, references)


for _task in OTHER_TASKS:
    TASKS.register(_task.name, _task, aliases=(_task.name.removeprefix("ruler:"),))
TASKS.register(Ruler.name, Ruler)
