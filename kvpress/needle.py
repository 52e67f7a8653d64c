"""A deterministic needle-in-a-haystack prompt, sized in the model's own tokens (used by the demo and tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

_SUBJECTS = ["The river", "A merchant", "The old library", "Our neighbour", "The committee", "A small boat",
             "The gardener", "The village choir", "A tired engineer", "The northern road"]
_VERBS = ["remembered", "described", "ignored", "repaired", "painted", "visited", "counted", "measured",
          "followed", "studied"]
_OBJECTS = ["the morning fog", "a pile of letters", "the broken fence", "seven copper bowls", "the winter market",
            "a list of recipes", "the quiet harbour", "an unfinished map", "the stone bridge", "a box of maps"]
_TAILS = ["before the rain began.", "while the bells rang.", "for most of the afternoon.", "without a word.",
          "as the lamps were lit.", "near the end of the season.", "with unusual care.", "after supper."]


# The assistant turn starts with this, so the number is the first thing generated.
ANSWER_PREFIX = "The secret passcode is"


@dataclass(frozen=True)
class NeedlePrompt:
    input_ids: "torch.Tensor"  # noqa: F821  [1, n]
    answer: str
    n_tokens: int
    depth: float


def haystack_sentences(seed: int):
    rng = random.Random(seed)
    while True:
        yield f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"


def filler(tokenizer, n_tokens: int, seed: int) -> list[str]:
    """Haystack sentences adding up to about `n_tokens` of the tokenizer's tokens (each counted with its space)."""
    sentences, used = [], 0
    for sentence in haystack_sentences(seed):
        used += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        if used > n_tokens:
            return sentences
        sentences.append(sentence)


def needle_prompt(tokenizer, n_tokens: int, depth: float = 0.5, seed: int = 0) -> NeedlePrompt:
    """A chat prompt of about `n_tokens` tokens: filler text with one needle sentence at `depth` (0 = start,
    1 = end of the document), then the question last (as query-aware compression expects)."""
    rng = random.Random(seed)
    answer = str(rng.randint(10000, 99999))
    needle = f"The secret passcode is {answer}. "
    question = "What is the secret passcode mentioned in the document? Answer with the number only."
    frame = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Document:\n\nQUESTION: {question}"}], add_generation_prompt=True, tokenize=False
    ) + ANSWER_PREFIX
    budget = n_tokens - len(tokenizer(frame, add_special_tokens=False).input_ids) - len(
        tokenizer(needle, add_special_tokens=False).input_ids
    )
    sentences, used = [], 0
    for sentence in haystack_sentences(seed):
        cost = len(tokenizer(" " + sentence, add_special_tokens=False).input_ids)
        if used + cost > budget:
            break
        sentences.append(sentence)
        used += cost
    sentences.insert(round(depth * len(sentences)), needle.strip())
    document = " ".join(sentences)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Document:\n{document}\n\nQUESTION: {question}"}],
        add_generation_prompt=True, tokenize=False,
    ) + ANSWER_PREFIX
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return NeedlePrompt(ids, answer, ids.shape[1], depth)
