"""LongBench v1 (THUDM/LongBench, folder LongBench/): sixteen English datasets as evalkit tasks.

Data: the published records (fields input, context, answers, length, dataset,
language, all_classes, _id), read from `<name>.jsonl` in a folder (the
constructor's `data_dir`, else $EVALKIT_LONGBENCH_DIR; LongBench's data.zip
unpacks to such a folder), else from the hub with
`datasets.load_dataset("THUDM/LongBench", name, split="test")` unless
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say the hub is off.

Prompts and generation lengths are LongBench's config/dataset2prompt.json and
dataset2maxlen.json. Each template is cut where the Sample fields meet:
`context` is the template up to and including {context}, `question` the rest
(with {input}) less the one newline the runner puts between them, and
`answer_prefix` is empty. So `context + "\n" + question` is LongBench's prompt
exactly. The one exception is lcc and repobench-p, whose templates have no
newline after {context}: there the context's own final newline is left to the
runner's separator, which is exact when the code ends with a newline (and one
newline more than LongBench's otherwise). The answer cues ("Answer:", "The
answer is: ") stay in the question because LongBench puts the whole prompt in
the user turn of the chat template; evalkit would put an answer prefix after
the assistant turn opens.

Length: LongBench tokenises the whole prompt and, when it is longer than the
model's budget, keeps the first and the last half-budget of tokens. Here the
context alone is cut in the middle, by characters, until the prompt (measured
with the `prompt_length` callback, chat template included) plus
`max_new_tokens` fits `length`: the kept head and tail are balanced so that the
prompt before the cut and after it have as many characters as each other (a
long question takes its share from the tail of the context), as LongBench's
halves have as many tokens.

Scoring: eval.py's per-dataset metric (evalkit.tasks.metrics), the best over
the answers, the prediction first cut to its first line for trec, triviaqa and
samsum, and `all_classes` for trec. Other differences from LongBench's pred.py
that the task cannot make itself are left in `meta["chat_template"]`: LongBench
feeds trec, triviaqa, samsum, lcc and repobench-p to chat models without their
chat template (False there); and for samsum it stops generating at the first
newline, which the first-line cut makes equivalent for the score.

Chinese datasets (multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh)
are not built.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path

from evalkit.errors import EvalkitError
from evalkit.tasks.base import MAX_CHARS_PER_TOKEN, TASKS, PromptLength, Sample, Task
from evalkit.tasks.data_source import iter_jsonl
from evalkit.tasks.haystack import fit_size
from evalkit.tasks.metrics import METRICS, first_line

HUB_DATASET = "THUDM/LongBench"
DATA_DIR_ENV = "EVALKIT_LONGBENCH_DIR"
SOURCE = "THUDM/LongBench: LongBench/config, pred.py, eval.py, metrics.py"
_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


@dataclass(frozen=True)
class DatasetSpec:
    """One LongBench dataset: its prompt template, generation length and how eval.py scores it."""

    template: str  # dataset2prompt.json, placeholders {context} and {input}
    max_new_tokens: int  # dataset2maxlen.json
    metric: str  # a METRICS name (eval.py's dataset2metric)
    first_line: bool = False  # eval.py keeps only the prediction's first line
    chat_template: bool = True  # pred.py wraps the prompt in the chat template
    description: str = ""


_MULTI_DOC_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    'based on the information in the article, write "unanswerable". If the question is a yes/no question, answer '
    '"yes", "no", or "unanswerable". Do not provide any explanation.'
)
_NARRATIVE_RULES = "asconcisely as you can, using a single phrase if possible. Do not provide any explanation."  # sic
_CODE = "Please complete the code given below. \n{context}"

DATASETS: dict[str, DatasetSpec] = {
    "narrativeqa": DatasetSpec(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        f"{_NARRATIVE_RULES}\n\nStory: {{context}}\n\nNow, answer the question based on the story "
        f"{_NARRATIVE_RULES}\n\nQuestion: {{input}}\n\nAnswer:",
        128, "qa_f1", description="single-document QA over a whole book or movie script"),
    "qasper": DatasetSpec(
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
        f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
        "Question: {input}\n\nAnswer:",
        128, "qa_f1", description="single-document QA over an NLP paper"),
    "multifieldqa_en": DatasetSpec(
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        64, "qa_f1", description="single-document QA over documents of many fields"),
    "hotpotqa": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", description="multi-hop QA over Wikipedia passages"),
    "2wikimqa": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", description="multi-hop QA over 2WikiMultihopQA passages"),
    "musique": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", description="multi-hop QA over MuSiQue passages"),
    "gov_report": DatasetSpec(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        512, "rouge_l", description="summarise a government report"),
    "qmsum": DatasetSpec(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
        512, "rouge_l", description="query-based summary of a meeting transcript"),
    "multi_news": DatasetSpec(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:",
        512, "rouge_l", description="summarise several news articles"),
    "trec": DatasetSpec(
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n{input}",
        64, "classification", first_line=True, chat_template=False,
        description="few-shot question-type classification (TREC, 50 classes)"),
    "triviaqa": DatasetSpec(
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}",
        32, "qa_f1", first_line=True, chat_template=False, description="few-shot reading comprehension (TriviaQA)"),
    "samsum": DatasetSpec(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
        128, "rouge_l", first_line=True, chat_template=False, description="few-shot dialogue summarisation (SAMSum)"),
    "passage_count": DatasetSpec(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        32, "count", description="count the distinct paragraphs among shuffled duplicates"),
    "passage_retrieval_en": DatasetSpec(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: ",
        32, "retrieval", description="find which of 30 paragraphs an abstract summarises"),
    "lcc": DatasetSpec(_CODE + "Next line of code:\n", 64, "code_sim", chat_template=False,
                       description="complete the next line of a long code file"),
    "repobench-p": DatasetSpec(_CODE + "{input}Next line of code:\n", 64, "code_sim", chat_template=False,
                               description="complete the next line of code given cross-file context"),
}
ENGLISH = tuple(DATASETS)


def _hub_is_off() -> str | None:
    """The environment variable that turns the hub off, if one does (huggingface_hub's reading of it)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return variable
    return None


def load_records(dataset: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """A LongBench dataset's test records, in published order: from a local folder, else the hub."""
    if dataset not in DATASETS:
        raise EvalkitError(f"unknown LongBench dataset {dataset!r}; built: {', '.join(DATASETS)}")
    folder = data_dir or os.environ.get(DATA_DIR_ENV)
    if folder:
        path = Path(folder) / f"{dataset}.jsonl"
        if not path.is_file():
            raise EvalkitError(f"LongBench {dataset}: no {path} (LongBench's data.zip unpacks to <name>.jsonl files)")
        records, where = list(iter_jsonl(path)), str(path)
    else:
        off = _hub_is_off()
        if off:
            raise EvalkitError(f"LongBench {dataset}: no local data and the hub is off ({off} is set); "
                               f"point {DATA_DIR_ENV} at a folder of <name>.jsonl files (LongBench's data.zip)")
        try:
            import datasets  # slow to import: only a run that reads the hub needs it (not `evalkit tasks`)

            records, where = [dict(r) for r in datasets.load_dataset(HUB_DATASET, dataset, split="test")], HUB_DATASET
        except Exception as error:  # any failure to fetch is the user's environment: one line, not a traceback
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise EvalkitError(f"LongBench {dataset}: cannot load {HUB_DATASET} from the hub ({reason}); "
                               f"point {DATA_DIR_ENV} at a folder of <name>.jsonl files") from None
    return check_records(records, dataset, where)


def check_records(records: list[dict], dataset: str, where: str) -> list[dict]:
    """The records, refused with the place of the first that lacks a field `dataset` needs."""
    needed = ("input", "context", "answers", "all_classes") if DATASETS[dataset].metric == "classification" \
        else ("input", "context", "answers")
    for number, record in enumerate(records, 1):
        missing = [name for name in needed if name not in record]
        if missing:
            raise EvalkitError(f"{where}: record {number} of {dataset} lacks {', '.join(missing)}")
        if not isinstance(record["answers"], list) or not record["answers"]:
            raise EvalkitError(f"{where}: record {number} of {dataset} needs a non-empty list of answers")
    return records


def split_template(template: str) -> tuple[str, str, bool]:
    """(context part ending with {context}, question part, whether the runner's "\\n" is the template's own).

    The question part is what follows {context}, less its first newline when there is one.
    """
    head, tail = template.split("{context}")
    if tail.startswith("\n"):
        return head + "{context}", tail[1:], True
    return head + "{context}", tail, False


def cut_middle(text: str, kept: int, before: int, after: int) -> str:
    """`kept` characters of `text`, its head and tail, cut in the middle.

    `before` and `after` are the prompt's characters on either side of `text`; the head gets
    what brings the prompt before the cut to half of the kept prompt, within [0, kept].
    """
    if kept >= len(text):
        return text
    kept = max(kept, 0)
    head = min(max((before + kept + after) // 2 - before, 0), kept)
    return text[:head] + text[len(text) - (kept - head):]


class LongBenchTask(Task):
    """One LongBench dataset. `meta` holds the dataset, LongBench's _id, length (its word count),
    all_classes, the context's characters (`context_chars`) and those kept (`kept_chars`, less
    only when the context was cut), and `chat_template` (see the module docstring)."""

    source = SOURCE

    def __init__(self, dataset: str, data_dir: str | os.PathLike | None = None, records: list[dict] | None = None):
        """`records`, when given, are the dataset's records from elsewhere (a user's file), already
        passed through `check_records`; otherwise they are loaded on first use."""
        if dataset not in DATASETS:
            raise EvalkitError(f"unknown LongBench dataset {dataset!r}; built: {', '.join(DATASETS)}")
        self.dataset, self.data_dir, self.spec = dataset, data_dir, DATASETS[dataset]
        self.name = f"longbench:{dataset}"
        self.description = f"LongBench {dataset}: {self.spec.description}"
        self.metric = self.spec.metric
        self._records = records

    @property
    def records(self) -> list[dict]:
        """The dataset's records, loaded on first use (listing tasks loads nothing)."""
        if self._records is None:
            self._records = load_records(self.dataset, self.data_dir)
        return self._records

    @property
    def all_classes(self) -> list[str] | None:
        """The class names eval.py passes to every metric: those of the dataset's last record."""
        return self.records[-1].get("all_classes") if self.records else None

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        records = self.records
        if n > len(records):
            raise EvalkitError(f"{self.name} has {len(records)} samples; {n} asked for")
        chosen = sorted(random.Random(seed).sample(range(len(records)), n))
        return [self.fit(prompt_length, length, index) for index in chosen]

    def score(self, prediction: str, references: list[str], meta: dict | None = None) -> float:
        """eval.py's score; `meta` (the sample's) may give all_classes, else the dataset's are used."""
        if self.spec.first_line:
            prediction = first_line(prediction)
        if self.metric != "classification":
            return METRICS[self.metric](prediction, references)
        all_classes = (meta or {}).get("all_classes") or self.all_classes
        return METRICS[self.metric](prediction, references, all_classes=all_classes)

    def fit(self, prompt_length: PromptLength, length: int, index: int) -> Sample:
        """Record `index` as a sample whose prompt plus answer fits `length` tokens, its context cut
        in the middle when it is too long (see the module docstring)."""
        prompt_tokens = length - self.spec.max_new_tokens
        if prompt_tokens <= 0:
            raise EvalkitError(f"length {length} leaves no room for a prompt ({self.spec.max_new_tokens} new tokens)")
        build = functools.partial(self._sample, index, self.records[index])
        whole = build(None)
        measured = whole.meta["context_chars"]  # the context's characters in the prompt measured first
        if measured <= prompt_tokens * MAX_CHARS_PER_TOKEN:
            tokens = prompt_length(whole)
            if tokens <= prompt_tokens:
                return whole
        else:  # it cannot fit at any tokenisation: tokenising it all (50 MB: over a minute) would say no more
            measured = prompt_tokens * MAX_CHARS_PER_TOKEN
            tokens = prompt_length(build(measured))  # the fit's first guess; the cut is of the whole context still
        if prompt_length(build(0)) > prompt_tokens:
            raise EvalkitError(f"{self.name} sample {index}: the prompt without its context is over the "
                               f"{prompt_tokens} tokens the length leaves; raise the length")
        kept = fit_size(lambda size: prompt_length(build(size)), prompt_tokens, guess=measured * prompt_tokens // tokens)
        return build(kept)

    def _sample(self, index: int, record: dict, kept: int | None) -> Sample:
        context_part, question_part, separated = split_template(self.spec.template)
        document = str(record["context"])
        if not separated and document.endswith("\n"):
            document = document[:-1]  # the runner's "\n" stands in for it
        head = context_part.removesuffix("{context}")
        question = question_part.replace("{input}", str(record["input"]))
        kept_document = document if kept is None else cut_middle(document, kept, len(head), len(question))
        return Sample(
            id=f"{self.dataset}-{index:04d}",
            context=head + kept_document,
            question=question,
            answer_prefix="",
            references=[str(answer) for answer in record["answers"]],
            max_new_tokens=self.spec.max_new_tokens,
            meta={"dataset": self.dataset, "_id": record.get("_id"), "length": record.get("length"),
                  "all_classes": record.get("all_classes"), "context_chars": len(document),
                  "kept_chars": len(kept_document), "chat_template": self.spec.chat_template},
        )


class LongBenchGroup(Task):
    """All sixteen English datasets: n samples shared out as evenly as possible, in DATASETS order,
    each sample's meta["task"] naming its dataset's task; scores go to that task's metric."""

    name = "longbench"
    description = "LongBench v1, the 16 English datasets (single/multi-doc QA, summaries, few-shot, synthetic, code)"
    source = SOURCE
    metric = "per dataset"

    def __init__(self, data_dir: str | os.PathLike | None = None):
        self.tasks = {f"longbench:{name}": LongBenchTask(name, data_dir) for name in ENGLISH}
        self._made: dict[tuple[str, ...], str | None] = {}  # references -> task, for score without meta

    def samples(self, prompt_length: PromptLength, length: int, n: int, seed: int) -> list[Sample]:
        samples = []
        for rank, (name, task) in enumerate(self.tasks.items()):
            share = n // len(self.tasks) + (rank < n % len(self.tasks))
            for sample in task.samples(prompt_length, length, share, seed) if share else []:
                samples.append(dataclasses.replace(sample, meta={**sample.meta, "task": name}))
                key = tuple(sample.references)
                self._made[key] = name if self._made.get(key, name) == name else None
        return samples

    def score(self, prediction: str, references: list[str], meta: dict | None = None) -> float:
        """The score of the sample's own dataset, found from meta["task"] or else from the references
        of the samples this group made (refused when two datasets made the same ones)."""
        name = (meta or {}).get("task") or self._made.get(tuple(references))
        if name not in self.tasks:
            raise ValueError("the longbench group scores a sample by its meta['task']; none given or known")
        return self.tasks[name].score(prediction, references, meta)


for _name in ENGLISH:
    TASKS.register(f"longbench:{_name}", functools.partial(LongBenchTask, _name))
TASKS.register(LongBenchGroup.name, LongBenchGroup)
