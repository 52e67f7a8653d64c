"""RULER's task families, generated locally: needle in a haystack (single, multi-key, multi-value, multi-query;
noise / essay / needle haystacks), variable tracking, common and frequent words extraction, and QA over
generated documents. Templates, answer prefixes and task parameters follow RULER (scripts/synthetic.yaml and
constants.py). Each builder takes (rng seed, n haystack units) and is deterministic in both; `generate` sizes
n so the prompt has `length` tokens in the model's own tokenizer."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from ..samples import Question, Sample, fit, seed_for
from . import text
from .text import DEPTHS, NEEDLE, NOISE, distinct_values, essay_sentences, insert_at_depths
from .words import ADJECTIVES, NOUNS, VERBS

NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {kind} afterwards.\n{context}")
NIAH_QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_PREFIX = "The special magic {kind} for {query} mentioned in the provided text are"


@dataclass(frozen=True)
class Niah:
    haystack: str  # "noise" | "essay" | "needle"
    key_kind: str
    value_kind: str
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", queries=4),
}
# Tokens to generate: RULER's budgets are upper bounds for chatty models; these fit the answers (SmolLM2's
# tokenizer spells digits and hex one token each: a uuid is ~36 tokens) with room for the answer's framing.
MAX_NEW = {"numbers": 10, "words": 10, "uuids": 40}


def _niah(cfg: Niah, seed: int, n: int, depth: float | None, questions: int) -> Sample:
    rng = random.Random(seed)
    n_keys = max(cfg.keys, cfg.queries, questions)
    keys = distinct_values(rng, cfg.key_kind, n_keys)
    values = [distinct_values(rng, cfg.value_kind, cfg.values) for _ in keys]
    needles = [NEEDLE.format(kind=cfg.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if depth is not None:
        if len(needles) != 1:
            raise ValueError(f"depth={depth}: a fixed depth needs a single-needle task (niah_single_*)")
        depths = [depth]
    else:
        depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
    if cfg.haystack == "noise":
        units, sep = [NOISE] * n, "\n"
    elif cfg.haystack == "essay":
        sentences = essay_sentences(rng)
        units, sep = [next(sentences) for _ in range(n)], " "
    else:  # distractor needles with other keys
        distractor_keys = distinct_values(rng, cfg.key_kind, n, exclude=keys)
        units = [NEEDLE.format(kind=cfg.value_kind, key=k, value=text.random_value(rng, cfg.value_kind))
                 for k in distractor_keys]
        sep = "\n"
    context = sep.join(insert_at_depths(units, needles, depths))

    def question(query_keys):
        one = len(query_keys) * cfg.values == 1
        kind = cfg.value_kind[:-1] if one else cfg.value_kind  # RULER's singular phrasing for one answer
        query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
        q = NIAH_QUESTION.format(kind=kind, query=query)
        prefix = NIAH_PREFIX.format(kind=kind, query=query)
        if one:
            q, prefix = q.replace("What are all", "What is"), prefix.replace(" are", " is")
        answers = [v for k in query_keys for v in values[keys.index(k)]]
        return Question(q, answers, prefix)

    if questions > 1:
        asked = [question([k]) for k in rng.sample(keys, questions)]
    else:
        asked = [question(rng.sample(keys, cfg.queries))]
    max_new = 8 + MAX_NEW[cfg.value_kind] * cfg.values * cfg.queries
    return Sample("", 0, NIAH_TEMPLATE.format(kind=cfg.value_kind, context=context), asked, "string_match_all",
                  max_new, meta=dict(depths=depths))


# ---------------------------------------------------------------------------- variable tracking
VT_TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are:")


def _chain(rng: random.Random, hops: int, letters: int):
    names = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choices(string.ascii_uppercase, k=letters)))
    names = rng.sample(sorted(names), hops + 1)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, value, statements


def _vt_context(rng, n_noise, statements):
    units = [NOISE] * n_noise
    positions = sorted(rng.sample(range(n_noise + 1), len(statements))) if n_noise + 1 >= len(statements) else \
        list(range(len(statements)))
    for offset, (pos, stmt) in enumerate(zip(positions, statements)):  # keep the chain's order
        units.insert(pos + offset, stmt)
    return "\n".join(units)


def _vt(seed: int, n: int, hops: int = 4) -> Sample:
    rng = random.Random(seed)
    # RULER prepends one solved example (3-letter names) so the answer format is clear.
    ex_names, ex_value, ex_statements = _chain(rng, hops, 3)
    example = (VT_TEMPLATE.format(context=_vt_context(rng, 5, ex_statements))
               + VT_QUESTION.format(value=ex_value) + " "
               + VT_PREFIX.format(n=hops + 1, value=ex_value) + " " + " ".join(ex_names) + "\n\n")
    names, value, statements = _chain(rng, hops, 5)
    context = example + VT_TEMPLATE.format(context=_vt_context(rng, n, statements))
    q = Question(VT_QUESTION.format(value=value), names, VT_PREFIX.format(n=hops + 1, value=value))
    return Sample("", 0, context, [q], "string_match_all", 40)


# ---------------------------------------------------------------------------- common words extraction
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}")
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
CWE_WORDS = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))


def _word_list(rng, n_words, common_repeats, uncommon_repeats, n_common=10):
    if n_words > len(CWE_WORDS):
        raise ValueError(f"length is too long for cwe: it needs {n_words} distinct words, the list has "
                         f"{len(CWE_WORDS)}")
    chosen = rng.sample(CWE_WORDS, n_words)
    common, uncommon = chosen[:n_common], chosen[n_common:]
    words = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(words)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common


def _cwe(seed: int, n: int, length: int) -> Sample:
    rng = random.Random(seed)
    # RULER's two regimes: below 4K tokens, 6 vs 1 repeats; from 4K, 30 vs 3 (and a larger example).
    small = length < 4096
    ex_context, ex_answer = _word_list(rng, 20 if small else 40, 3 if small else 10, 1 if small else 3)
    example = (CWE_TEMPLATE.format(context=ex_context) + CWE_QUESTION + " " + CWE_PREFIX + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)) + "\n\n")
    context, answer = _word_list(rng, 10 + n, 6 if small else 30, 1 if small else 3)
    q = Question(CWE_QUESTION, answer, CWE_PREFIX)
    return Sample("", 0, example + CWE_TEMPLATE.format(context=context), [q], "string_match_all", 64)


# ---------------------------------------------------------------------------- frequent words extraction
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


def _fwe(seed: int, n: int, length: int, alpha: float = 2.0) -> Sample:
    rng = random.Random(seed)
    vocab_size = max(10, length // 50)  # RULER: max_seq_length // 50
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise
    zeta = sum(k ** -alpha for k in range(1, 100_000))  # zeta(alpha), truncated far beyond any vocab
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / zeta))]
    rng.shuffle(words)
    q = Question(FWE_QUESTION, vocab[1:4], FWE_PREFIX)
    return Sample("", 0, FWE_TEMPLATE.format(context=" ".join(words)), [q], "string_match_all", 24)


# ---------------------------------------------------------------------------- QA over generated documents
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.\n\nThe following are given documents.\n\n{context}\n\n")
QA_QUESTION = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.\n\nQuestion: {question}")
QA_PREFIX = "Answer:"
_FIRST = ("Ada Bram Cora Dario Elin Farah Goran Hedda Ilse Jonas Kira Lucan Mira Nils Odile Pavel Quinn Rosa "
          "Soren Talia Ugo Vera Wim Xenia Yusuf Zora Anselm Brisa Cosmo Delia Emeric Fenna Gideon Halle Ivo "
          "Juno Kasimir Leona Matteo Noor Orla Piet Rhea Silas Tove Umberto Vanya Wren").split()
_LAST = ("Abernathy Brightwater Castellan Dunmore Everhart Fairweather Galloway Hollins Ingram Jessop Kettering "
         "Lindqvist Marchetti Northcote Oyelaran Pembrook Quarrie Ravensworth Stroud Thistlewood Underhill Vance "
         "Whitcombe Yardley Zeller Ashdown Blackwood Crane Delacroix Elsworth Fenwick Greaves Halloran Iversen "
         "Jardine Kowalczyk Lockhart Merriweather Nakamura Osterberg").split()
_CITIES = ("Varnholt Quenby Ostrava Drellin Marrow Caldera Pinsk Tolvane Ashgrove Brightmoor Corvale Dunwick "
           "Elmsford Fallowmere Glenhaven Harrowgate Ivybridge Juniper Kestrel Lindenhall Merrivale Northwold "
           "Oakhurst Pellham Quarrystone Rookwood Saltmarsh Thornbury Umberlee Valemount Westerly Yarrowby "
           "Zephyrine Amberlyn Blackmere Coldharbour").split()
_PROFESSIONS = ("architect baker beekeeper cartographer chemist clockmaker dentist engineer florist geologist "
                "glassblower historian illustrator jeweller journalist librarian locksmith mapmaker midwife "
                "musician navigator nurse optician pharmacist photographer pilot potter printer sculptor surveyor "
                "tailor translator veterinarian weaver").split()
_INSTRUMENTS = ("accordion bagpipes banjo bassoon cello clarinet double bass dulcimer flute harmonica harp "
                "harpsichord mandolin oboe piano saxophone sitar trombone trumpet tuba ukulele viola violin "
                "xylophone").replace("double bass", "double-bass").split()
QA_FACTS = {  # attribute -> (fact sentence, question)
    "profession": ("{name} works as a {value}.", "What does {name} work as?"),
    "city": ("{name} lives in the town of {value}.", "In which town does {name} live?"),
    "instrument": ("{name}'s favourite instrument is the {value}.", "What is the favourite instrument of {name}?"),
}
QA_DISTRACTORS = 2  # people documents besides the asked ones


def _qa(seed: int, n: int, questions: int) -> Sample:
    """RULER's QA shape without SQuAD: documents of essay prose (n sentences, 4 per document), among them a few
    documents about people (the asked ones and QA_DISTRACTORS others); every name is unique, so each answer sits
    in exactly one document. Calibrated for small models: with facts about dozens of near-identical people,
    SmolLM2-135M answers almost nothing even with its full cache (see docs/results)."""
    rng = random.Random(seed)
    names = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], questions + QA_DISTRACTORS)
    people = [dict(name=name, profession=rng.choice(_PROFESSIONS), city=rng.choice(_CITIES),
                   instrument=rng.choice(_INSTRUMENTS)) for name in names]
    sentences = essay_sentences(rng)
    prose = [[next(sentences) for _ in range(min(4, n - i))] for i in range(0, n, 4)]
    slots = sorted(rng.sample(range(len(prose) + len(people)), len(people)))
    order = rng.sample(range(len(people)), len(people))  # which person sits in which slot
    docs, people_docs = [], {}
    for d in range(len(prose) + len(people)):
        if d in slots:
            p = people[order[slots.index(d)]]
            people_docs[p["name"]] = d + 1
            body = " ".join(QA_FACTS[a][0].format(name=p["name"], value=p[a]) for a in QA_FACTS)
        else:
            body = " ".join(prose[d - sum(s < d for s in slots)])
        docs.append(f"Document {d + 1}:\n{body}")
    qs = []
    for p in people[:questions]:
        attribute = rng.choice(list(QA_FACTS))
        qs.append(Question(QA_QUESTION.format(question=QA_FACTS[attribute][1].format(name=p["name"])),
                           [p[attribute]], QA_PREFIX))
    return Sample("", 0, QA_TEMPLATE.format(context="\n\n".join(docs)), qs, "string_match_part", 24,
                  meta=dict(asked_documents=[people_docs[p["name"]] for p in people[:questions]]))


# ---------------------------------------------------------------------------- registry
TASKS = [*NIAH, "vt", "cwe", "fwe", "qa"]
# The default suite: six families that a run of a few policies x ratios x lengths can afford on a CPU.
DEFAULT_TASKS = ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "niah_multivalue", "qa"]
MULTI_QUESTION_TASKS = {"qa", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3"}


def builder(task: str, seed: int, length: int, depth: float | None = None, questions: int = 1):
    """n -> Sample with n haystack units."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; allowed values: {TASKS}")
    if questions > 1 and task not in MULTI_QUESTION_TASKS:
        raise ValueError(f"questions={questions}: task {task!r} asks one question; allowed for "
                         f"{sorted(MULTI_QUESTION_TASKS)}")
    if depth is not None and not task.startswith("niah_single"):
        raise ValueError(f"depth={depth}: only single-needle tasks take a depth; allowed for niah_single_*")
    if task in NIAH:
        return lambda n: _niah(NIAH[task], seed, n, depth, questions)
    if task == "vt":
        return lambda n: _vt(seed, n)
    if task == "cwe":
        return lambda n: _cwe(seed, n, length)
    if task == "fwe":
        return lambda n: _fwe(seed, n, length)
    return lambda n: _qa(seed, n, questions)


def generate(task: str, tokenizer, length: int, index: int, seed: int = 0, depth: float | None = None,
             questions: int = 1) -> Sample:
    """Sample `index` of `task`, with a prompt of ~`length` tokens (chat template included) in `tokenizer`."""
    build = builder(task, seed_for("ruler", task, length, index, seed), length, depth, questions)
    sample = fit(build, tokenizer, length)
    sample.task, sample.index = task, index
    sample.meta.update(target_length=length, seed=seed)
    return sample

