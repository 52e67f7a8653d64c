"""Local haystacks and random values for the RULER-style tasks (no downloads).

RULER's "essay" haystack is Paul Graham's essays; here it is essay-like prose from a small grammar, drawn from a
seeded generator, so it is varied text (unlike the repeated "noise" line) and needs nothing from a hub."""

from __future__ import annotations

import random
import uuid

from .words import ADJECTIVES, NOUNS

# RULER's "noise" haystack line and its needle format.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
# RULER draws needle depths (percent) from this grid.
DEPTHS = [round(i * 100 / 39) for i in range(40)]

_OPENERS = ["", "", "", "In practice, ", "Surprisingly, ", "For a long time, ", "If you look closely, ",
            "As a rule, ", "Historically, ", "In my experience, ", "Oddly enough, ", "Sooner or later, "]
_SUBJECTS = ["most founders", "good writers", "the best programmers", "investors", "young companies",
             "people who make things", "small teams", "most employees", "new startups", "many students",
             "ambitious people", "the earliest users", "large organizations", "most critics", "good teachers",
             "the people around you", "careful readers", "the smartest engineers"]
_VERBS = ["underestimate", "care about", "tend to ignore", "learn from", "rarely notice", "depend on",
          "worry about", "spend years on", "eventually discover", "should pay attention to", "often misjudge",
          "quietly build on", "end up copying", "argue about", "are surprised by", "keep returning to"]
_OBJECTS = ["how long things take", "the problems of their users", "the value of a simple design",
            "what their competitors are doing", "the cost of meetings", "the importance of writing clearly",
            "the difference between work and busywork", "the early signs of growth",
            "a question nobody else is asking", "the habits they formed in school", "the shape of the market",
            "the advice of older people", "the ideas that seem like toys", "their own curiosity",
            "the gap between plans and results", "small improvements that compound"]
_TAILS = ["", "", "because it is hard to see from the inside", "which is why so few of them succeed",
          "and that turns out to matter more than anything else", "even when the evidence is obvious",
          "at least in the beginning", "though this changes with experience", "for reasons that are not obvious",
          "until something forces them to look", "and the effect grows over time"]


def essay_sentences(rng: random.Random):
    while True:
        text = (f"{rng.choice(_OPENERS)}{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
                f"{' ' + t if (t := rng.choice(_TAILS)) else ''}.")
        yield text[0].upper() + text[1:]


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))  # 7 digits, as RULER
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"kind={kind!r}; allowed values: 'numbers', 'words', 'uuids'")


def distinct_values(rng: random.Random, kind: str, n: int, exclude=()) -> list[str]:
    out, seen = [], set(exclude)
    while len(out) < n:
        value = random_value(rng, kind)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def insert_at_depths(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert each item between units, at round(depth * len(units)) (depth 0: before everything, 1: after)."""
    out = list(units)
    for position, item in sorted(zip((round(d * len(units)) for d in depths), items), key=lambda p: p[0],
                                 reverse=True):
        out.insert(position, item)
    return out
