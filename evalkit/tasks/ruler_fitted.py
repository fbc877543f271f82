"""The base class of every RULER task fitted to a length (`FittedTask`: vt, cwe and fwe in
`evalkit.tasks.ruler_synthetic`, qa_1 and qa_2 in `evalkit.tasks.ruler_qa`): each sample a draw around a
haystack whose size is fitted so that the prompt has the tokens the length leaves, and `SOURCE`, where
RULER's own scripts are.
"""

from __future__ import annotations

import functools
import random
from abc import abstractmethod
from typing import Any, ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import PromptLength, Sample, Task
from evalkit.tasks.haystack import first_guess, fit_size
from evalkit.tasks.metrics import METRICS

SOURCE = "NVIDIA/RULER scripts/data/synthetic/{script}, constants.py and scripts/synthetic.yaml"


class FittedTask(Task):
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
        prompt_tokens = length - self.max_new_tokens
        if prompt_tokens <= 0:
            raise EvalkitError(f"length {length} leaves no room for a prompt ({self.max_new_tokens} new tokens)")
        rng = random.Random(seed)
        setup = self._setup(prompt_length, length, n, rng)
        size, samples = None, []
        for index in range(n):
            build = functools.partial(self._build, setup, index, self._draw(setup, rng, index))

            def measure(size: int) -> int:
                return prompt_length(build(size))

            if size is None:  # later samples start from the previous fit
                size = first_guess(measure, prompt_tokens, self.probe)
            size = fit_size(measure, prompt_tokens, size)
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
