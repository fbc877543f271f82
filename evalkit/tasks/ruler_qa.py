"""RULER's question answering (qa.py): `ruler:qa_1` (SQuAD v2 dev) and `ruler:qa_2` (HotpotQA dev,
distractor setting), the paragraphs holding the answer among distractor paragraphs. The data is a
local file (the environment variable each source names) or the Hugging Face hub. Registered by
`evalkit.tasks.ruler`.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from evalkit.errors import EvalkitError
from evalkit.tasks.base import Sample
from evalkit.tasks.ruler_fitted import SOURCE, FittedTask

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
        import datasets  # slow to import: only a run that reads the hub needs it (not `evalkit tasks`)

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


class QaTask(FittedTask):
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
    source = SOURCE.format(script="qa.py") + "; SQuAD v2 dev"
    dataset = "squad"


class Qa2(QaTask):
    name = "ruler:qa_2"
    description = "RULER qa_2: answer a HotpotQA multi-hop question from paragraphs among distractor paragraphs"
    source = SOURCE.format(script="qa.py") + "; HotpotQA dev (distractor)"
    dataset = "hotpotqa"
