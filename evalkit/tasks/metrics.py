"""RULER's per-sample metrics (NVIDIA/RULER scripts/eval/synthetic/constants.py).

RULER scores a whole prediction file and reports mean × 100 rounded to two
decimals; here each function scores one prediction in [0, 1] and the runner
aggregates. Predictions are first cleaned as RULER's `postprocess_pred` does.

LongBench's metrics follow them, then those of the long-answer tasks.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

from evalkit.tasks.haystack import split_sentences

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, turn control characters into newlines, strip again."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def _hits(prediction: str, references: list[str]) -> list[float]:
    if not references:
        raise ValueError("a RULER metric needs at least one reference")
    text = postprocess(prediction).lower()
    return [float(reference.lower() in text) for reference in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references found in the prediction, ignoring case."""
    hits = _hits(prediction, references)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found in the prediction, ignoring case, else 0."""
    return max(_hits(prediction, references))


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


# --- LongBench (THUDM/LongBench, LongBench/metrics.py and eval.py) ---------------------------
#
# Each `*_score` function below scores a prediction against ONE ground truth, as LongBench's
# functions of the same names do; the METRICS entries take the max over all references, starting
# from 0, as LongBench's eval.py does, and refuse an empty reference list. Quirks of the originals
# are kept on purpose, so that the numbers are LongBench's: they are pointed out where they occur.

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_NUMBERS = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def first_line(prediction: str) -> str:
    """eval.py's cleaning for trec, triviaqa, samsum and lsht: leading newlines dropped, first line kept."""
    return prediction.lstrip("\n").split("\n")[0]


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, punctuation removed, then articles, then extra whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 of the normalised answers; tokens count with multiplicity (bag of words)."""
    predicted, truth = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(predicted) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def _lcs_words(reference: list[str], candidate: list[str]) -> list[str]:
    """The words of one longest common subsequence, the one the `rouge` package's backtrack picks.

    Which subsequence is picked matters, since only its distinct words count: walking back from
    the end, a match is taken, else the step goes up (dropping a reference word) only when that
    keeps a strictly longer LCS, and otherwise left (dropping a candidate word).
    """
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            if reference[i - 1] == candidate[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words, i, j = [], rows, cols
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            words.append(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_sentences(text: str) -> list[list[str]]:
    """The `rouge` package's reading of a text: pieces between periods (empty pieces dropped
    before whitespace is collapsed, so a blank piece stays as one empty word), split on spaces."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def rouge_l_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F as LongBench gets it: `rouge.Rouge().get_scores(...)["rouge-l"]["f"]` (rouge 1.0.1).

    That is the summary-level union LCS of the ROUGE working note, counted the way the package
    counts by default (`exclusive=True`): over distinct words. With the text cut into sentences at
    every ".", it is F = 2PR / (P + R + 1e-8), where P and R divide the number of distinct words
    lying on the LCS of some (reference sentence, predicted sentence) pair by the number of
    distinct words in the prediction and in the reference. Case-sensitive; no stemming; no
    tokenisation beyond spaces. Where the package raises (a text with no sentence, such as "" or
    "..."), LongBench scores 0.

    Not reproduced: the package backtracks recursively, so a sentence pair of about a thousand
    words together overflows Python's recursion limit and LongBench scores it 0; here it is scored.
    (PyPI's `rouge_score` is a different ROUGE-L: lower-cased alphanumeric tokens, one LCS over the
    whole text with repeats counted; it gives 0.8333 where this gives 0.8 on "the cat sat on the
    mat" against "the cat lay on the mat".)
    """
    predicted, truth = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not predicted or not truth:
        return 0.0
    on_lcs = set()
    for reference in truth:
        for candidate in predicted:
            on_lcs.update(_lcs_words(reference, candidate))
    precision = len(on_lcs) / len({word for sentence in predicted for word in sentence})
    recall = len(on_lcs) / len({word for sentence in truth for word in sentence})
    return 2.0 * (precision * recall / (precision + recall + 1e-8))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """1 / (number of classes named) if the true class is among the class names found in the prediction.

    Class names are found by case-sensitive substring; a found name that is a proper substring of
    the true class is dropped. LongBench drops them while iterating over the same list, so the
    name just after a dropped one is never examined (and stays): reproduced here.
    """
    found = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(found):  # a list iterator's walk, over a list that shrinks as it goes
        name = found[index]
        index += 1
        if name in ground_truth and name != ground_truth:
            found.remove(name)
    return 1.0 / len(found) if ground_truth in found else 0.0


def _share_equal_to(prediction: str, number: str) -> float:
    """Fraction of the numbers (digit runs) in the prediction that are exactly `number`; 0 with none."""
    numbers = _NUMBERS.findall(prediction)
    return sum(found == number for found in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """The ground truth is "Paragraph N": the fraction of the prediction's numbers that are N."""
    match = _PARAGRAPH.search(ground_truth)
    if match is None:
        raise ValueError(f"a retrieval reference names a paragraph as 'Paragraph N', not {ground_truth!r}")
    return _share_equal_to(prediction, match.group(1))


def count_score(prediction: str, ground_truth: str) -> float:
    """The fraction of the prediction's numbers (digit runs) that are the ground truth, as strings."""
    return _share_equal_to(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """fuzzywuzzy's `fuzz.ratio` / 100 between the first code line of the prediction and the truth.

    The first code line is the first line (after leading newlines) with no "`", "#" or "//"; ""
    if there is none. fuzzywuzzy 0.18 without python-Levenshtein (LongBench installs none) is
    difflib's SequenceMatcher ratio, 100 for equal strings, 0 when either is empty, otherwise
    rounded to a whole percent with Python's round (half to even).
    """
    line = next((text for text in prediction.lstrip("\n").split("\n")
                 if "`" not in text and "#" not in text and "//" not in text), "")
    if line == ground_truth:
        return 1.0
    if not line or not ground_truth:
        return 0.0
    return int(round(100 * difflib.SequenceMatcher(None, line, ground_truth).ratio())) / 100


def _best(score_one: Callable[..., float], prediction: str, references: list[str], **extra) -> float:
    if not references:
        raise ValueError("a LongBench metric needs at least one reference")
    best = 0.0
    for reference in references:
        best = max(best, score_one(prediction, reference, **extra))
    return best


def qa_f1(prediction: str, references: list[str]) -> float:
    """LongBench's qa_f1_score, best over the references."""
    return _best(qa_f1_score, prediction, references)


def rouge_l(prediction: str, references: list[str]) -> float:
    """LongBench's rouge_score (ROUGE-L F of the `rouge` package), best over the references."""
    return _best(rouge_l_score, prediction, references)


def classification(prediction: str, references: list[str], *, all_classes: Sequence[str] | None = None) -> float:
    """LongBench's classification_score, best over the references; needs the task's `all_classes`."""
    if not references:
        raise ValueError("a LongBench metric needs at least one reference")
    if all_classes is None:
        raise ValueError("the classification metric needs all_classes, the list of class names")
    return _best(classification_score, prediction, references, all_classes=all_classes)


def retrieval(prediction: str, references: list[str]) -> float:
    """LongBench's retrieval_score (English, "Paragraph N"), best over the references."""
    return _best(retrieval_score, prediction, references)


def count(prediction: str, references: list[str]) -> float:
    """LongBench's count_score, best over the references."""
    return _best(count_score, prediction, references)


def code_sim(prediction: str, references: list[str]) -> float:
    """LongBench's code_sim_score, best over the references."""
    return _best(code_sim_score, prediction, references)


METRICS.update(qa_f1=qa_f1, rouge_l=rouge_l, classification=classification, retrieval=retrieval,
               count=count, code_sim=code_sim)


def exact(prediction: str, references: list[str]) -> float:
    """SQuAD's exact match: 1 if the prediction equals one of the references once both are normalised
    by `normalize_answer` (case, punctuation, articles and spacing ignored), else 0."""
    if not references:
        raise ValueError("exact match needs at least one reference")
    answer = normalize_answer(prediction)
    return float(any(answer == normalize_answer(reference) for reference in references))


METRICS["exact"] = exact


# --- Long answers (evalkit.tasks.long_answer) -------------------------------------------------
#
# The references are the units of one long answer (lines, sentences), in order. Units compare whole, with
# runs of whitespace read as one space.

def _units_in_order(units: list[str], references: list[str]) -> float:
    """The longest common subsequence of `units` and `references` over the number of references."""
    if not references:
        raise ValueError("a long-answer metric needs at least one reference unit")
    units, references = [" ".join(u.split()) for u in units], [" ".join(r.split()) for r in references]
    previous = [0] * (len(references) + 1)
    for unit in units:
        row = [0]
        for j, reference in enumerate(references):
            row.append(previous[j] + 1 if unit == reference else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1] / len(references)


def units_before_first_error(units: list[str], references: list[str]) -> int:
    """How many references `units` repeat one for one from the first, before the first that differs (blank units
    skipped, whitespace runs compared as one space): how far into a long answer it stays exact."""
    units = [" ".join(u.split()) for u in units if u.strip()]
    exact = 0
    for unit, reference in zip(units, references):
        if unit != " ".join(reference.split()):
            break
        exact += 1
    return exact


def lines_in_order(prediction: str, references: list[str]) -> float:
    """Fraction of the reference lines the prediction's lines hold whole and in order (an LCS of lines).

    A line left out, or out of order, costs its share; a repeated or extra line costs nothing (`edit_similarity`
    charges those), so a looping answer scores the lines it has before the loop."""
    return _units_in_order(UNITS["lines_in_order"](prediction), references)


def sentences_in_order(prediction: str, references: list[str]) -> float:
    """`lines_in_order` with sentences: the prediction is cut where a sentence ends (`haystack.split_sentences`)."""
    return _units_in_order(UNITS["sentences_in_order"](prediction), references)


# How each in-order metric cuts a prediction into the units it compares with the references.
UNITS = {"lines_in_order": lambda text: text.splitlines(),
         "sentences_in_order": lambda text: split_sentences(text.strip())}


def edit_similarity(prediction: str, references: list[str]) -> float:
    """1 - (word-level Levenshtein distance) / (the longer's word count), the references joined as one text.

    Words are runs of non-space characters; a wrong word, a missing one and an extra one each cost 1, so an
    answer twice as long as the reference scores at most 0.5. Two empty texts score 1."""
    if not references:
        raise ValueError("a long-answer metric needs at least one reference unit")
    predicted, truth = prediction.split(), " ".join(references).split()
    if not predicted and not truth:
        return 1.0
    previous = list(range(len(truth) + 1))
    for i, word in enumerate(predicted, 1):
        row = [i]
        for j, reference in enumerate(truth, 1):
            row.append(min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (word != reference)))
        previous = row
    return 1 - previous[-1] / max(len(predicted), len(truth))


METRICS.update(lines_in_order=lines_in_order, sentences_in_order=sentences_in_order, edit_similarity=edit_similarity)
