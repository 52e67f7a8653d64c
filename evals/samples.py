"""What every suite produces: a Sample (a context and one or more questions about it), and how a sample
becomes token ids, split where the context ends so that both evaluation modes see the same tokens."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

_SPLIT = "<<<KVPRESS-EVAL-SPLIT>>>"


@dataclass
class Question:
    text: str  # follows the context inside the user turn
    answers: list[str]
    answer_prefix: str = ""  # starts the assistant turn, so the answer comes first


@dataclass
class Sample:
    task: str
    index: int
    context: str  # instruction + document: what query-agnostic mode compresses before any question
    questions: list[Question]
    metric: str  # a name in evals.metrics.METRICS
    max_new_tokens: int
    chat: bool = True  # wrap in the model's chat template when it has one
    meta: dict = field(default_factory=dict)  # e.g. depth, target length, all_classes


def seed_for(*parts) -> int:
    """A stable seed from task name, length, index and the user's seed (Python's hash() is salted per process)."""
    return zlib.crc32(":".join(map(str, parts)).encode())


def encode(tokenizer, sample: Sample, question: Question, max_tokens: int | None = None):
    """(context_ids, question_ids): lists of token ids whose concatenation is the full prompt. Query-aware mode
    prefills both at once; query-agnostic mode prefills the first, then extends with the second.
    `max_tokens` truncates the middle of the prompt, as LongBench does (both ends hold instructions)."""
    if sample.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context + _SPLIT + question.text}],
            add_generation_prompt=True, tokenize=False,
        )
        head, tail = text.split(_SPLIT)
        head_ids = tokenizer(head, add_special_tokens=False).input_ids
    else:
        head, tail = sample.context, question.text
        head_ids = tokenizer(head).input_ids  # BOS, if the tokenizer adds one
    tail += question.answer_prefix
    tail_ids = tokenizer(tail, add_special_tokens=False).input_ids
    if max_tokens is not None:
        head_ids, tail_ids = truncate_middle(head_ids, tail_ids, max_tokens)
    return head_ids, tail_ids


def truncate_middle(head: list[int], tail: list[int], max_tokens: int):
    """Keep the first max_tokens // 2 and the last max_tokens - max_tokens // 2 ids of head + tail (LongBench's
    cut), and report where the head now ends."""
    ids = head + tail
    if len(ids) <= max_tokens:
        return head, tail
    first = max_tokens // 2
    last_start = len(ids) - (max_tokens - first)
    kept = ids[:first] + ids[last_start:]
    boundary = len(head)
    if boundary <= first:
        new_boundary = boundary
    elif boundary >= last_start:
        new_boundary = first + boundary - last_start
    else:
        new_boundary = first
    return kept[:new_boundary], kept[new_boundary:]


def prompt_length(tokenizer, sample: Sample) -> int:
    head, tail = encode(tokenizer, sample, sample.questions[0])
    return len(head) + len(tail)


def fit(build, tokenizer, target: int, start: int = 8):
    """The sample `build(n)` whose prompt is closest to `target` tokens, over the unit count n (sentences,
    documents, words...). `build` must be deterministic in n, and longer for larger n."""
    lengths = {}

    def length(n):
        if n not in lengths:
            lengths[n] = prompt_length(tokenizer, build(n))
        return lengths[n]

    lo, lo_len = 0, length(0)
    if lo_len > target:
        raise ValueError(f"length={target} is too short for this task: its fixed parts alone take {lo_len} tokens")
    hi = start
    while length(hi) <= target:  # grow until past the target, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if length(mid) <= target:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda n: abs(length(n) - target))
    return build(best)
