"""`ruler`, all thirteen RULER tasks at once, and the registration of those beyond needles
(NVIDIA/RULER scripts/data/synthetic/): needles in `ruler_niah`, vt/cwe/fwe in `ruler_synthetic`,
qa_1/qa_2 in `ruler_qa`.

- `ruler:vt`, `ruler:cwe`, `ruler:fwe`: described in `evalkit.tasks.ruler_synthetic`.
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
import os

from evalkit.errors import EvalkitError
from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks.ruler_niah import NIAH_TASKS
from evalkit.tasks.ruler_qa import QA_SOURCES, Qa1, Qa2, QaTask
from evalkit.tasks.ruler_synthetic import CommonWordsExtraction, FrequentWordsExtraction, VariableTracking


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
