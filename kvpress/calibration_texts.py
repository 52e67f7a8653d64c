"""The calibration corpus: local text only, the same on every machine with the same Python.

Documents assembled from Python's own standard-library docstrings and kvpress's needle haystack, with random facts
(numbers, names, codes) inserted; none of it from the evals' generators and nothing from a hub. `kvpress calibrate`
fits KVzap's predictor, the head ranking, Double Sparsity's channels, CommVQ's codebooks and LESS's maps on it.
"""

from __future__ import annotations

import importlib
import inspect
import random

from .needle import haystack_sentences

# Standard-library modules whose docstrings make the calibration prose (local, deterministic per Python version).
_DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "decimal", "difflib",
                "email", "enum", "fractions", "functools", "glob", "gzip", "heapq", "hmac", "html", "http.client",
                "imaplib", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "mimetypes", "operator",
                "optparse", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex",
                "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
                "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib.parse", "uuid",
                "warnings", "weakref", "xml.dom", "zipfile", "zoneinfo")
_NAMES = ("Alice", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kasia", "Liam",
          "Mei", "Nikos", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Viktor", "Wen", "Yara")
_PLACES = ("Lisbon", "Osaka", "Tromso", "Quito", "Nairobi", "Tbilisi", "Perth", "Utrecht", "Cusco", "Hanoi",
           "Bergen", "Accra", "Leipzig", "Split", "Dakar", "Cork", "Tartu", "Fez", "Hobart", "Kyoto")
_THINGS = ("locker", "account", "parcel", "ticket", "badge", "invoice", "archive", "vault", "shipment", "permit")


def _docstrings() -> list[str]:
    paragraphs = []
    for name in _DOC_MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except Exception:  # noqa: BLE001 - a module missing from this Python build just contributes nothing
            continue
        paragraphs += [p.replace("\n", " ").strip() for p in doc.split("\n\n") if len(p.split()) >= 8]
    return paragraphs


def _fact(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"The {rng.choice(_THINGS)} number for {rng.choice(_NAMES)} is {rng.randint(100000, 9999999)}."
    if kind == 1:
        return f"{rng.choice(_NAMES)} moved to {rng.choice(_PLACES)} in {rng.randint(1950, 2024)}."
    code = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(8))
    return f"Remember the {rng.choice(_THINGS)} code {code} for {rng.choice(_PLACES)}."


def calibration_texts(tokenizer, n_texts: int, n_tokens: int, seed: int = 0) -> list[list[int]]:
    """`n_texts` prompts of about `n_tokens` tokens each (the model's chat template around a document when it has
    one): docstring paragraphs and haystack sentences in random order, a fact every few sentences."""
    paragraphs = _docstrings()
    out = []
    for t in range(n_texts):
        rng = random.Random(seed * 1000 + t)
        filler = haystack_sentences(seed * 1000 + t)
        parts, used = [], 0
        while used < n_tokens:
            pick = rng.random()
            part = rng.choice(paragraphs) if pick < 0.45 and paragraphs else _fact(rng) if pick < 0.7 else next(filler)
            parts.append(part)
            used += len(tokenizer.encode(" " + part, add_special_tokens=False))
        document = " ".join(parts)
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": document}], add_generation_prompt=True,
                                                 tokenize=False)
            out.append(list(tokenizer.encode(text, add_special_tokens=False)))
        else:
            out.append(list(tokenizer.encode(document)))
    return out
