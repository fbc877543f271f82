"""LongBench v1's scoring, written from its published definitions, for tests to compare evalkit with.

Sources read (none of them imported, none needed at test time):
  - THUDM/LongBench `metrics.py` (English metrics) and `eval.py` (`dataset2metric`, `scorer`);
  - pltrdy/rouge 1.0.1 (`Rouge().get_scores(..., avg=True)["rouge-l"]["f"]`, which `rouge_score` calls);
  - seatgeek/fuzzywuzzy 0.18.0 (`fuzz.ratio`, which `code_sim_score` calls) without python-Levenshtein,
    i.e. on `difflib.SequenceMatcher`.

This module is deliberately written apart from `evalkit.tasks.metrics` and shares no code with it:
it follows the originals' control flow (their loops, their exceptions caught where they catch them)
rather than evalkit's, so that a test comparing the two compares two readings of the definition.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter

# --- metrics.py ---------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """lower -> drop string.punctuation -> articles to a space -> collapse whitespace (in that order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: list[str], ground_truth: list[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _share_of(numbers: list[str], wanted: str) -> float:
    right = 0
    for number in numbers:
        if str(number) == str(wanted):
            right += 1
    return 0.0 if len(numbers) == 0 else float(right / len(numbers))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return _share_of(re.findall(r"\d+", prediction), ground_truth)


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    paragraph = re.findall(r"Paragraph (\d+)", ground_truth)[0]  # IndexError without one, as published
    return _share_of(re.findall(r"\d+", prediction), paragraph)


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    matches = []
    for name in kwargs["all_classes"]:
        if name in prediction:
            matches.append(name)
    # Published quirk kept: removing from the list being iterated skips the element after each removal.
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    # `if em_match_list != 0:` in the original is always true (a list is never 0): the difflib
    # fallback after it is dead code, so it is not written here.
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def fuzz_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio`: decorators in order none-check, equality (100), empty (0)."""
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    code = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            code = line
            break
    return fuzz_ratio(code, ground_truth) / 100


# --- rouge 1.0.1, as rouge_score uses it ----------------------------------------------------------


class RougeError(ValueError):
    pass


def _rouge_sentences(text: str) -> list[str]:
    # Rouge._get_avg_scores: pieces between "." kept if non-empty, then whitespace collapsed.
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _words(sentences: list[str]) -> list[str]:
    out = []
    for sentence in sentences:
        out.extend(sentence.split(" "))
    return out


def _lcs_table(x: list[str], y: list[str]) -> dict[tuple[int, int], int]:
    table = {}
    for i in range(len(x) + 1):
        for j in range(len(y) + 1):
            if i == 0 or j == 0:
                table[i, j] = 0
            elif x[i - 1] == y[j - 1]:
                table[i, j] = table[i - 1, j - 1] + 1
            else:
                table[i, j] = max(table[i - 1, j], table[i, j - 1])
    return table


def _recon_lcs(x: list[str], y: list[str]) -> set[str]:
    """The words of the LCS the package's `_recon` returns (x: reference words, y: candidate words).

    The package recurses; this walks the same path with a loop (on texts long enough to hit
    Python's recursion limit the package raises and LongBench scores 0: tests keep texts short).
    """
    table = _lcs_table(x, y)
    i, j = len(x), len(y)
    picked = []
    while i != 0 and j != 0:
        if x[i - 1] == y[j - 1]:
            picked.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1, j] > table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return set(picked)  # exclusive=True: an Ngrams set


def rouge_l_summary_level(hyp_sentences: list[str], ref_sentences: list[str]) -> float:
    if len(hyp_sentences) <= 0 or len(ref_sentences) <= 0:
        raise RougeError("Collections must contain at least 1 sentence.")
    m = len(set(_words(ref_sentences)))
    n = len(set(_words(hyp_sentences)))
    union: set[str] = set()
    total = 0
    for ref in ref_sentences:
        before = len(union)
        ref_words = _words([ref])
        for hyp in hyp_sentences:
            union = union | _recon_lcs(ref_words, _words([hyp]))
        total += len(union) - before
    r_lcs, p_lcs = total / m, total / n
    return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))


def _rouge_n_check(hyp_sentences: list[str], ref_sentences: list[str]) -> None:
    # get_scores also computes rouge-1 and rouge-2 (Rouge.DEFAULT_METRICS), which raise on an empty
    # side before rouge-l is reached; on a non-empty side they cannot raise.
    if len(hyp_sentences) <= 0:
        raise RougeError("Hypothesis is empty.")
    if len(ref_sentences) <= 0:
        raise RougeError("Reference is empty.")


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    try:
        hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
        _rouge_n_check(hyp, ref)
        f = rouge_l_summary_level(hyp, ref)
    except Exception:  # metrics.py: a bare `except: return 0.0`
        return 0.0
    return f / 1  # avg=True over one pair


# --- eval.py -------------------------------------------------------------------------------------

DATASET2METRIC = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score, "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score, "musique": qa_f1_score, "gov_report": rouge_score, "qmsum": rouge_score,
    "multi_news": rouge_score, "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "passage_retrieval_en": retrieval_score, "passage_count": count_score, "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def score_one(dataset: str, prediction: str, ground_truths: list[str], all_classes) -> float:
    """eval.py's `scorer` for one prediction: first line for some datasets, best over the answers from 0."""
    score = 0.0
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    for ground_truth in ground_truths:
        score = max(score, DATASET2METRIC[dataset](prediction, ground_truth, all_classes=all_classes))
    return score
