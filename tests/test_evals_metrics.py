"""RULER and LongBench metrics on hand-made cases whose values are worked out in the comments."""

import random

import pytest

from evals.metrics import (classification, code_sim, count, edit_similarity, qa_f1, retrieval, rouge_l,
                           score_prediction, string_match_all, string_match_part)


def test_ruler_string_match():
    pred = "The numbers are 1234567 and 7654321."
    assert string_match_all(pred, ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_part(pred, ["1111111", "7654321"]) == 1.0
    assert string_match_part(pred, ["1111111"]) == 0.0
    assert string_match_all("UUID ABC-DEF\x00", ["abc-def"]) == 1.0  # case-insensitive, control chars dropped


def test_qa_f1():
    # normalised: "cat sat on mat" vs "cat on mat": 3 common, P = 3/4, R = 1, F1 = 1.5 / 1.75
    assert qa_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(1.5 / 1.75)
    assert qa_f1("Paris", "paris!") == 1.0
    assert qa_f1("London", "Paris") == 0.0


def test_rouge_l():
    # one sentence each; unique words 5 and 5; LCS "the cat on the mat" -> word set {the, cat, on, mat}: 4
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-7)
    # sentences split at '.': hyp [a b c], [d e]; ref [a d], [b e]. LCS words per ref sentence: {a, d}, then
    # {b, e}: union 4. R = 4/4, P = 4/5 (hyp has 5 unique words), F = 2 * 0.8 / 1.8
    assert rouge_l("a b c. d e", "a d. b e") == pytest.approx(1.6 / 1.8, abs=1e-7)
    assert rouge_l("", "a summary") == 0.0  # the rouge package raises; LongBench scores 0


def test_rouge_l_matches_the_rouge_package_when_installed():
    rouge = pytest.importorskip("rouge")  # not a dependency: an optional cross-check
    rng = random.Random(0)
    words = "the cat sat on mat a dog ran . and".split()
    for _ in range(300):
        a, b = (" ".join(rng.choice(words) for _ in range(rng.randint(1, 20))) for _ in range(2))
        try:
            expected = rouge.Rouge().get_scores([a], [b], avg=True)["rouge-l"]["f"]
        except Exception:
            expected = 0.0
        assert rouge_l(a, b) == pytest.approx(expected, abs=1e-12)


def test_classification():
    classes = ["Entity", "Human", "Location"]
    assert classification("Human", "Human", all_classes=classes) == 1.0
    assert classification("Entity or Human", "Human", all_classes=classes) == 0.5  # two classes named
    assert classification("Location", "Human", all_classes=classes) == 0.0
    # "Value" is a substring of the gold "Numeric Value": dropped, so the answer is not split
    assert classification("Numeric Value", "Numeric Value", all_classes=["Value", "Numeric Value"]) == 1.0


def test_edit_similarity_and_code_sim():
    # kitten / sitting: LCS "ittn" = 4, 2 * 4 / 13 = 61.5% -> 62
    assert edit_similarity("kitten", "sitting") == 62
    assert edit_similarity("abcd", "abce") == 75  # 2 * 3 / 8
    assert edit_similarity("abc", "abc") == 100 and edit_similarity("", "abc") == 0
    assert code_sim("```python\n    return x + 12\n```", "    return x + 12") == 1.0  # fence line skipped
    # first clean line "return x + 12" (13 chars) vs "    return x + 12" (17): LCS 13, 26 / 30 -> 87
    assert code_sim("# add twelve\nreturn x + 12", "    return x + 12") == 0.87


def test_count_and_retrieval():
    assert count("There are 5 unique paragraphs, maybe 6", "5") == 0.5
    assert count("no idea", "5") == 0.0
    assert retrieval("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval("Paragraph 3, not Paragraph 12", "Paragraph 3") == 0.5


def test_score_prediction_best_reference_and_first_line():
    # vs "Paris": tokens [paris, is, answer, more], P = 1/4, R = 1 -> 0.4; the first line alone: P = 1/3 -> 0.5
    assert score_prediction("qa_f1", "Paris is the answer\nmore", ["London", "Paris"]) == pytest.approx(0.4)
    assert score_prediction("qa_f1", "Paris is the answer\nmore", ["London", "Paris"], first_line=True) == \
        pytest.approx(0.5)
    with pytest.raises(ValueError, match="metric="):
        score_prediction("bleu", "x", ["x"])


def test_best_config_within_a_byte_budget_needs_as_many_samples_as_the_full_cache():
    """A config scored on a few lucky samples is shown on the frontier (with its n) but is not named the best
    config at a byte budget; the best is chosen among configs measured like the full cache."""
    from evals.report import accuracy_per_byte, best_within, frontier_markdown

    def cell(task, policy, ratio, score, cache_bytes, n):
        return dict(task=task, length=4096, mode="query_agnostic", policy=policy, ratio=ratio, n=n, score=score,
                    kv_bytes=cache_bytes, cache_bytes=cache_bytes, prefill_s=1.0, decode_s=1.0, new_tokens=5.0)

    summary = [cell(t, "none", 0.0, 60.0, 1000, 20) for t in ("a", "b")]
    summary += [cell(t, "lucky", 0.5, 90.0, 100, 3) for t in ("a", "b")]
    summary += [cell("a", "measured", 0.5, 55.0, 150, 20), cell("b", "measured", 0.5, 50.0, 150, 20)]
    points = accuracy_per_byte(summary)
    assert {p["policy"]: p["n"] for p in points} == {"none": 20, "lucky": 3, "measured": 20}
    assert best_within(points, 0.25)["policy"] == "lucky"  # without a sample floor, the lucky one wins
    best = best_within(points, 0.25, min_n=20)
    assert (best["policy"], best["score"], best["bytes"]) == ("measured", 52.5, 0.15)
    text = frontier_markdown(summary)
    assert "| 25% | measured @ 0.50 | 15.0% | 52.5 | 88% | 20 |" in text
    assert "| lucky @ 0.50 | 10.0% | 90.0 | 3 |" in text
