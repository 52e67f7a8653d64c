"""Generators: deterministic by seed, sized in the model's tokens, needles where asked, and gold answers that an
independent brute-force reading of the context recovers."""

import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from evals import longbench, needle
from evals.ruler import TASKS, generate
from evals.samples import Question, Sample, encode, prompt_length, truncate_middle
from kvpress.models import model_path


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(model_path("smollm2"))


def _text(sample):
    return sample.context + "".join(q.text + q.answer_prefix for q in sample.questions)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed(tok, task):
    a, b = generate(task, tok, 1024, 3, seed=7), generate(task, tok, 1024, 3, seed=7)
    assert _text(a) == _text(b) and [q.answers for q in a.questions] == [q.answers for q in b.questions]
    assert _text(generate(task, tok, 1024, 3, seed=8)) != _text(a)
    assert _text(generate(task, tok, 1024, 4, seed=7)) != _text(a)


@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_token_length_within_2_percent(tok, length):
    for task in TASKS:
        n = prompt_length(tok, generate(task, tok, length, 0))
        assert abs(n - length) <= 0.02 * length, (task, length, n)
    for depth in (0.0, 0.5, 1.0):
        n = prompt_length(tok, needle.generate(tok, length, depth, 0))
        assert abs(n - length) <= 0.02 * length, ("needle", length, n)


def _depth_of(context, needle_text, haystack_start, tok):
    """Share of the haystack's tokens that sit before the needle."""
    before = len(tok(context[haystack_start:context.index(needle_text)], add_special_tokens=False).input_ids)
    total = len(tok(context[haystack_start:].replace(needle_text, ""), add_special_tokens=False).input_ids)
    return before / total


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_niah_needle_once_at_requested_depth(tok, task, depth):
    s = generate(task, tok, 2048, 1, depth=depth)
    (value,) = s.questions[0].answers
    needles = re.findall(r"One of the special magic \w+ for \S+ is: \S+\.", s.context)
    assert len(needles) == 1 and value in needles[0] and s.context.count(value) == 1
    start = s.context.index("afterwards.\n") + len("afterwards.\n")
    assert abs(_depth_of(s.context, needles[0], start, tok) - depth) < 0.02


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_suite_once_at_requested_depth(tok, depth):
    s = needle.generate(tok, 2048, depth, 2)
    found = re.findall(r"The secret passcode is (\d+)\.", s.context)
    assert found == s.questions[0].answers
    assert abs(_depth_of(s.context, f"The secret passcode is {found[0]}.", len("Document:\n"), tok) - depth) < 0.02


# ---------------------------------------------------------------------------- brute-force checkers
def _check_niah(s):
    needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", s.context)
    by_key = {}
    for key, value in needles:
        by_key.setdefault(key, []).append(value)
    for q in s.questions:
        query = re.search(r"for (.+) mentioned in the provided text\?", q.text).group(1)
        keys = re.split(r", and |, ", query)
        expected = [v for k in keys for v in by_key[k]]
        assert sorted(expected) == sorted(q.answers)
        assert all(s.context.count(f"for {k} is:") == len(by_key[k]) for k in keys)


def _check_vt(s):
    main = s.context.rsplit("Memorize and track", 1)[1]  # skip the solved example
    assignments = dict(re.findall(r"VAR (\w+) = (\d+|VAR \w+)", main))

    def value(name, hops=0):
        v = assignments[name]
        return value(v[4:], hops + 1) if v.startswith("VAR ") else v

    target = re.search(r"assigned the value (\d+)", s.questions[0].text).group(1)
    assert sorted(n for n in assignments if value(n) == target) == sorted(s.questions[0].answers)


def _check_cwe(s):
    main = s.context.rsplit("Below is a numbered list", 1)[1]
    counts = Counter(re.findall(r"\d+\. (\w+)", main)).most_common()
    assert sorted(w for w, _ in counts[:10]) == sorted(s.questions[0].answers)
    assert counts[9][1] > counts[10][1]  # the top 10 are unambiguous


def _check_fwe(s):
    words = s.context.split("coded words. ", 1)[1].split()
    counts = [(w, c) for w, c in Counter(words).most_common() if w != "..."]
    assert [w for w, _ in counts[:3]] == s.questions[0].answers
    assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]


_FACTS = {"work as": r"{name} works as a (\S+)\.", "live": r"{name} lives in the town of (\S+)\.",
          "instrument": r"{name}'s favourite instrument is the (\S+)\."}


def _check_qa(s):
    docs = re.findall(r"Document (\d+):\n(.*?)(?=\n\nDocument |\n\n$)", s.context + "\n\n", flags=re.S)
    assert [int(i) for i, _ in docs] == list(range(1, len(docs) + 1))
    for q in s.questions:
        name = re.search(r"(?:does|of) ([A-Z]\w+ [A-Z]\w+)", q.text).group(1)
        holding = [body for _, body in docs if name in body]
        assert len(holding) == 1  # the person has exactly one document
        pattern = next(p for cue, p in _FACTS.items() if cue in q.text)
        assert re.findall(pattern.format(name=re.escape(name)), holding[0]) == q.answers


@pytest.mark.parametrize("task", TASKS)
def test_gold_answers_derivable_from_context(tok, task):
    check = {"vt": _check_vt, "cwe": _check_cwe, "fwe": _check_fwe, "qa": _check_qa}.get(task, _check_niah)
    for index in range(4):
        for length in (1024, 4096):
            check(generate(task, tok, length, index))


@pytest.mark.parametrize("task", ["qa", "niah_multikey_1", "niah_multikey_2"])
def test_several_questions_share_one_context(tok, task):
    s = generate(task, tok, 2048, 0, questions=3)
    assert len(s.questions) == 3 and len({q.text for q in s.questions}) == 3
    (_check_qa if task == "qa" else _check_niah)(s)
    heads = {tuple(encode(tok, s, q)[0]) for q in s.questions}
    assert len(heads) == 1  # query-agnostic mode prefills this once


def test_bad_generator_arguments(tok):
    with pytest.raises(ValueError, match="task="):
        generate("niah_single_9", tok, 1024, 0)
    with pytest.raises(ValueError, match="questions="):
        generate("vt", tok, 1024, 0, questions=2)
    with pytest.raises(ValueError, match="length="):
        generate("cwe", tok, 40, 0)


# ---------------------------------------------------------------------------- LongBench loading and truncation
def test_truncate_middle_keeps_both_ends():
    head, tail = list(range(100)), list(range(100, 110))
    h, t = truncate_middle(head, tail, 40)
    assert h + t == list(range(20)) + list(range(90, 110)) and t == tail
    h, t = truncate_middle(head, tail, 400)  # fits: unchanged
    assert (h, t) == (head, tail)


def test_longbench_fixture_loads_and_truncates_in_the_middle(tok, tmp_path):
    names = longbench.write_fixture(tmp_path)
    assert set(names) == {"narrativeqa", "gov_report", "trec", "lcc"}
    for name in names:
        records = longbench.load_records(name, tmp_path)
        assert len(records) == 3 and {"context", "input", "answers", "all_classes", "length"} <= set(records[0])
        full_head, full_tail = encode(tok, longbench.to_sample(records[0], name, 0), longbench.to_sample(
            records[0], name, 0).questions[0])
        budget = len(full_head) + len(full_tail) - 41
        s = longbench.to_sample(records[0], name, 0, max_tokens=budget)
        head, tail = encode(tok, s, s.questions[0], max_tokens=s.meta["max_tokens"])
        assert len(head) + len(tail) == budget and tail == full_tail  # the question survives whole
        half = budget // 2
        assert head[:half] == full_head[:half] and (head + tail)[half:] == (full_head + full_tail)[-(budget - half):]
    trec = longbench.to_sample(longbench.load_records("trec", tmp_path)[0], "trec", 0)
    assert not trec.chat and trec.metric == "classification" and trec.meta["first_line"]
    with pytest.raises(ValueError, match="dataset="):
        longbench.load_records("vcsum", tmp_path)
    with pytest.raises(ValueError, match="data="):
        longbench.load_records("narrativeqa", tmp_path / "missing")


def test_encode_splits_where_the_context_ends(tok):
    s = Sample("t", 0, "Some context.", [Question("\nWhat?", ["x"], "Answer:")], "string_match_all", 4)
    head, tail = encode(tok, s, s.questions[0])
    assert tok.decode(head).endswith("Some context.") and tok.decode(tail).startswith("\nWhat?")
    assert tok.decode(tail).endswith("assistant\nAnswer:")
