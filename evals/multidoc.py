"""Multi-document tasks (issue 52): several documents, each compressed apart, one question over all of them.

  needle_in_doc  N documents of filler; one of them (document k, k taken in turn over the samples) holds a code
                 sentence; the question asks for the code.
  two_facts      two of the N documents each hold one code; the question asks for both (a fact from each).

A sample is its documents (plain text, each a RAG chunk), the question and the expected values; scoring is
string_match_all (the fraction of the expected values the answer contains, RULER's metric). Documents are sized in
the model's own tokens, so every method sees the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpress.needle import filler

from .metrics import string_match_all

TASKS = ("needle_in_doc", "two_facts")
_NAMES = ["the blue vault", "the east gate", "the night train", "the old mill", "the red archive", "the south pier",
          "the glass tower", "the copper mine", "the silent lake", "the north bridge"]


@dataclass(frozen=True)
class Sample:
    task: str
    index: int
    documents: list[str]
    question: str
    answers: list[str]
    holders: list[int]  # which documents hold the facts


def _document(tokenizer, n_tokens: int, seed: int, facts: list[str]) -> str:
    """Filler sentences up to about `n_tokens` tokens, with `facts` at evenly spread places."""
    sentences = filler(tokenizer, n_tokens, seed)
    for i, fact in enumerate(facts):
        sentences.insert(round((i + 1) * len(sentences) / (len(facts) + 1)), fact)
    return " ".join(sentences)


def generate(task: str, tokenizer, index: int, documents: int = 4, doc_tokens: int = 1024, seed: int = 0) -> Sample:
    if task not in TASKS:
        raise ValueError(f"task={task!r}; allowed values: {list(TASKS)}")
    rng = random.Random(f"{task}/{index}/{seed}")
    names = rng.sample(_NAMES, 2)
    codes = [str(rng.randint(1_000_000, 9_999_999)) for _ in names]
    facts = [f"The access code of {name} is {code}." for name, code in zip(names, codes)]
    if task == "needle_in_doc":
        holders = [index % documents]
        question = f"What is the access code of {names[0]}? Answer with the number only."
        answers = codes[:1]
    else:
        first = index % documents
        holders = [first, (first + 1 + rng.randrange(documents - 1)) % documents]
        question = (f"What are the access codes of {names[0]} and of {names[1]}? Answer with the two numbers "
                    f"only.")
        answers = codes
    docs = [_document(tokenizer, doc_tokens, seed * 1000 + index * 10 + d,
                      [facts[holders.index(d)]] if d in holders else []) for d in range(documents)]
    return Sample(task, index, docs, question, answers, holders)


def score(sample: Sample, answer: str) -> float:
    return string_match_all(answer, sample.answers)
