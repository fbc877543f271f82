"""Several questions on one context, asked turn after turn on the same cache (`loop.conversation`).

- `ruler:multiturn_niah`: K needles of RULER's niah ("One of the special magic numbers for <key> is: <value>.",
  word keys, 7-digit values) in Paul Graham essays; turn i asks for the value of one key, in RULER's
  single-needle words, the keys in a random order (so turn index and needle depth do not go together).
- `ruler:multiturn_kv`: the key-value retrieval of "Lost in the Middle" (Liu et al., 2023): a JSON object of
  UUID keys and UUID values; turn i asks for the value of one key, in that paper's words.

`--task-arg turns=K` (default 4) sets the questions. Every turn is answered in up to the task's new tokens and
scored by RULER's string_match_all; a sample holds its first question in `question` and the others in
`followups`, so its first turn is exactly a single-question run of the same prompt. Needle depths: the i-th of
a sample's K needles (or asked pairs) sits at 100 × (position + i) / K percent, position running from 0 to 1
over the samples, as `ruler_niah` spreads them.
"""

from __future__ import annotations

import json
import random
from typing import ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task, Turn
from evalkit.tasks.haystack import first_guess, fit_size, haystack_text, insert_needles
from evalkit.tasks.metrics import string_match_all
from evalkit.tasks.ruler_niah import _RANDOM

_KNOWN_ARGS = ("turns",)
MAX_TURNS = 64


class MultiturnTask(Task):
    """K questions on one context; a subclass draws the context and questions (`_draw`, `_build`)."""

    metric = "string_match_all"
    max_new_tokens: ClassVar[int]  # per turn
    default_turns = 4

    def __init__(self, turns: int | None = None):
        self.turns = turns or self.default_turns

    def with_args(self, args: dict[str, str]) -> "MultiturnTask":
        unknown = sorted(set(args) - set(_KNOWN_ARGS))
        if unknown:
            raise EvalkitError(f"unknown {self.name} task-arg {', '.join(unknown)}; known: {', '.join(_KNOWN_ARGS)}")
        turns = args.get("turns", str(self.turns))
        if not turns.isdigit() or not 1 <= int(turns) <= MAX_TURNS:
            raise EvalkitError(f"{self.name} turns must be a whole number from 1 to {MAX_TURNS}, got {turns!r}")
        return type(self)(int(turns))

    def check_length(self, length: int) -> None:
        if self.turns * self.max_new_tokens >= length:
            raise EvalkitError(f"--length {length} leaves no room for a prompt: {self.turns} turns take "
                               f"{self.turns * self.max_new_tokens} new tokens ({self.max_new_tokens} each)")

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        self.check_length(length)
        prompt_tokens = length - self.turns * self.max_new_tokens  # every turn's prompt; the answers take the rest
        rng = random.Random(seed)
        samples, size = [], None
        for index in range(n):
            drawn = self._draw(rng, index / (n - 1) if n > 1 else 0.5)

            def measure(size: int) -> int:
                return prompt_length(self._build(index, drawn, size))

            size = fit_size(measure, prompt_tokens, size or first_guess(measure, prompt_tokens, probe=8))
            samples.append(self._build(index, drawn, size))
        return samples

    def score(self, prediction: str, references: list[str]) -> float:
        return string_match_all(prediction, references)

    def _sample(self, index: int, context: str, questions: list[tuple[str, str, str]], meta: dict) -> Sample:
        """`questions`: (question, answer prefix, answer) per turn."""
        (question, prefix, answer), *later = questions
        return Sample(id=f"{self.name.removeprefix('ruler:')}-{index:04d}", context=context, question=question,
                      answer_prefix=prefix, references=[answer], max_new_tokens=self.max_new_tokens,
                      meta={**meta, "turns": len(questions)},
                      followups=tuple(Turn(q, p, [a]) for q, p, a in later))


class MultiturnNiah(MultiturnTask):
    name = "ruler:multiturn_niah"
    description = "K RULER needles (word key, 7-digit number) in Paul Graham essays, one key asked per turn"
    source = "NVIDIA/RULER scripts/data/synthetic/niah.py (templates, needles); turns: evalkit"
    max_new_tokens = 32  # the answer prefix names the key: the answer is a number and a full stop

    _INSTRUCTION = ("Some special magic numbers are hidden within the following text. "
                    "Make sure to memorize it. I will quiz you about the numbers afterwards.\n")
    _QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
    _ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"
    _NEEDLE = "One of the special magic numbers for {key} is: {value}."

    def _draw(self, rng: random.Random, position: float) -> dict:
        keys, values = [], []
        while len(keys) < self.turns:  # distinct keys and values: each answer is in the context once
            key, value = _RANDOM["words"](rng), _RANDOM["numbers"](rng)
            if key not in keys and value not in values:
                keys.append(key), values.append(value)
        asked = rng.sample(range(self.turns), self.turns)  # turn t asks needle asked[t]
        return {"keys": keys, "values": values, "asked": asked,
                "depths": [100 * (position + i) / self.turns for i in range(self.turns)]}

    def _build(self, index: int, drawn: dict, size: int) -> Sample:
        needles = [self._NEEDLE.format(key=k, value=v) for k, v in zip(drawn["keys"], drawn["values"])]
        context = self._INSTRUCTION + insert_needles(haystack_text(size), needles, drawn["depths"])
        questions = [(self._QUESTION.format(key=drawn["keys"][i]), self._ANSWER_PREFIX.format(key=drawn["keys"][i]),
                      drawn["values"][i]) for i in drawn["asked"]]
        return self._sample(index, context, questions, {"depths": [drawn["depths"][i] for i in drawn["asked"]],
                                                        "keys": [drawn["keys"][i] for i in drawn["asked"]],
                                                        "haystack_words": size})


class MultiturnKv(MultiturnTask):
    name = "ruler:multiturn_kv"
    description = "Lost in the Middle's key-value retrieval (a JSON object of UUIDs), one key asked per turn"
    source = "nelson-liu/lost-in-the-middle kv_retrieval prompt (Liu et al., 2023); turns: evalkit"
    max_new_tokens = 48  # a UUID is 36 characters, up to some 30 tokens

    _INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
    _QUESTION = 'Key: "{key}"'
    _ANSWER_PREFIX = "\nCorresponding value:"

    def _draw(self, rng: random.Random, position: float) -> dict:
        return {"seed": rng.getrandbits(64), "asked_order": rng.sample(range(self.turns), self.turns),
                "depths": [100 * (position + i) / self.turns for i in range(self.turns)]}

    def _build(self, index: int, drawn: dict, size: int) -> Sample:
        pairs_rng = random.Random(drawn["seed"])  # the same first pairs at every size: longer means more tokens
        count = max(size, self.turns)
        pairs = [(_RANDOM["uuids"](pairs_rng), _RANDOM["uuids"](pairs_rng)) for _ in range(count)]
        places = [min(count - 1, int(count * depth / 100)) for depth in drawn["depths"]]  # distinct: count >= turns
        asked = [places[i] for i in drawn["asked_order"]]
        # One pair a line, as the paper's prompt writes the object.
        lines = ",\n ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs)
        context = self._INSTRUCTION + "{" + lines + "}\n"
        questions = [(self._QUESTION.format(key=pairs[i][0]), self._ANSWER_PREFIX, pairs[i][1]) for i in asked]
        return self._sample(index, context, questions, {"depths": [100 * i / count for i in asked],
                                                        "keys": [pairs[i][0] for i in asked], "pairs": count})


MULTITURN_TASKS = (MultiturnNiah, MultiturnKv)
for _task in MULTITURN_TASKS:
    TASKS.register(_task.name, _task, aliases=(_task.name.removeprefix("ruler:"),))
