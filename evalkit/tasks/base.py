"""What a task gives the runner (samples) and what it does with predictions (score)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from evalkit.errors import EvalkitError
from evalkit.registry import Registry


@dataclass(frozen=True)
class Turn:
    """A later question on the same context (a multi-turn task), asked once the previous answer is given."""

    question: str
    answer_prefix: str
    references: list[str]


@dataclass(frozen=True)
class Sample:
    """One request. The prompt is `context`, then `question`, then `answer_prefix`.

    `context` is what query-agnostic compression compresses before the question
    is seen; `question` and `answer_prefix` come after it. A multi-turn sample asks its
    `followups` one after another on the same cache (`loop.conversation`), each answered in up to
    `max_new_tokens`.
    """

    id: str
    context: str
    question: str
    answer_prefix: str
    references: list[str]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    followups: tuple[Turn, ...] = ()


PromptLength = Callable[[Sample], int]
"""Tokens the evaluated model sees for a sample (chat template included), every turn's prompt of a multi-turn
sample but not its answers: tasks fit lengths with it."""

# No token of a tokenizer spans more characters than this: SmolLM2's longest is 81 (a newline and 80
# spaces), common vocabularies' are under 100. A prompt of more characters than this many per token of
# --length holds more tokens than --length at any tokenisation (a token is at least one character).
MAX_CHARS_PER_TOKEN = 256


class Task(ABC):
    name: str
    description: str  # one line, for `evalkit tasks`
    source: str  # where the data and the semantics come from
    metric: str  # name of the metric `score` computes

    @abstractmethod
    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        """`n` samples whose prompt plus `max_new_tokens` fits in `length` tokens; same seed, same samples."""

    def check_length(self, length: int) -> None:
        """Refuse, before any model loads, a `length` that cannot hold this task's answers (EvalkitError)."""

    def with_args(self, args: dict[str, str]) -> "Task":
        """This task with `--task-arg` settings applied; tasks that take settings override this."""
        raise EvalkitError(f"task {self.name} takes no --task-arg settings, got {', '.join(sorted(args))}")

    @abstractmethod
    def score(self, prediction: str, references: list[str]) -> float:
        """Score in [0, 1] for one prediction."""

    def score_details(self, prediction: str, references: list[str]) -> dict[str, float]:
        """Other numbers of one prediction, kept in its record under "details" and averaged into metrics.json's
        "details" (a long answer's edit similarity beside its score); none by default."""
        return {}


TASKS: Registry[Task] = Registry("task")
