"""Scoring. RULER: string match (all / part). LongBench (English tasks): the official metrics of its
metrics.py, re-implemented without its dependencies (rouge, fuzzywuzzy, jieba) but to the same definitions.

Every metric returns a score in [0, 1] for one prediction; `score_prediction` applies the suite's rule over
several references (RULER passes them all at once; LongBench takes the best reference)."""

from __future__ import annotations

import re
import string
from collections import Counter


# ---------------------------------------------------------------------------- RULER
def _ruler_clean(pred: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", pred).strip()  # RULER's postprocess: control characters -> newline


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references that occur in the prediction (case-insensitive)."""
    pred = _ruler_clean(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference occurs in the prediction (case-insensitive)."""
    pred = _ruler_clean(prediction).lower()
    return float(any(r.lower() in pred for r in references))


# ---------------------------------------------------------------------------- LongBench
def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, articles and extra whitespace (SQuAD's normalisation)."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1(prediction: list[str], reference: list[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    """Token F1 between normalised answers."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _lcs_words(x: list[str], y: list[str]) -> list[str]:
    """One longest common subsequence of x and y, reconstructed as the `rouge` package does (walking back from
    the end, preferring to drop from y on ties)."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    out, i, j = [], n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            out.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def rouge_l(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F of the `rouge` package (what LongBench calls): summary-level union LCS over sentences split at
    '.', words split at ' ', counted as sets (its default exclusive=True); 0.0 where that package raises."""
    hyp = [" ".join(s.split()) for s in prediction.split(".") if len(s) > 0]
    ref = [" ".join(s.split()) for s in reference.split(".") if len(s) > 0]
    if not hyp or not ref:
        return 0.0  # the package raises on an empty side; LongBench scores that 0
    hyp_words = [s.split(" ") for s in hyp]
    ref_unique = len({w for s in ref for w in s.split(" ")})
    hyp_unique = len({w for s in hyp_words for w in s})
    union = set()
    for r in ref:
        r_words = r.split(" ")
        for h in hyp_words:
            union |= set(_lcs_words(r_words, h))
    lcs = len(union)
    recall, precision = lcs / ref_unique, lcs / hyp_unique
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def classification(prediction: str, reference: str, all_classes: list[str] = (), **_) -> float:
    """1 / (number of class names found) if the reference class is among them, else 0. Class names that are
    substrings of the reference are dropped first, exactly as LongBench's loop does (it removes from the list it
    iterates, so it can skip one)."""
    matches = [c for c in all_classes if c in prediction]
    for term in matches:  # same loop shape as the official code, skipping included
        if term in reference and term != reference:
            matches.remove(term)
    return 1.0 / len(matches) if reference in matches else 0.0


def edit_similarity(a: str, b: str) -> int:
    """fuzzywuzzy's fuzz.ratio with python-Levenshtein: round(100 * (1 - indel distance / total length))
    = round(100 * 2 * LCS / (len(a) + len(b))); 100 for equal strings, 0 if exactly one is empty."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for ch in a:
        cur = [0]
        for j, other in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if ch == other else max(prev[j], cur[j - 1]))
        prev = cur
    return int(round(100 * 2 * prev[-1] / (len(a) + len(b))))


def code_sim(prediction: str, reference: str, **_) -> float:
    """Edit similarity of the first generated line that is not a comment or a code fence."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return edit_similarity(line, reference) / 100


def count(prediction: str, reference: str, **_) -> float:
    """passage_count: the share of numbers in the prediction that equal the reference."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(reference) for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str, **_) -> float:
    """passage_retrieval_en: the share of numbers in the prediction that equal the reference paragraph's."""
    target = re.findall(r"Paragraph (\d+)", reference)[0]
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


LONGBENCH_METRICS = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification, "code_sim": code_sim,
                     "count": count, "retrieval": retrieval}
RULER_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
METRICS = [*RULER_METRICS, *LONGBENCH_METRICS]


def score_prediction(metric: str, prediction: str, answers: list[str], all_classes: list[str] | None = None,
                     first_line: bool = False) -> float:
    """Score in [0, 1]. RULER metrics see all references at once; LongBench ones keep the best reference, after
    cutting the prediction to its first line for the few-shot tasks (`first_line`), as LongBench's scorer does."""
    if metric in RULER_METRICS:
        return RULER_METRICS[metric](prediction, answers)
    if metric not in LONGBENCH_METRICS:
        raise ValueError(f"metric={metric!r} is unknown; allowed values: {METRICS}")
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = LONGBENCH_METRICS[metric]
    return max((fn(prediction, a, all_classes=all_classes or []) for a in answers), default=0.0)
