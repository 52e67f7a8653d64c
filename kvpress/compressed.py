"""Compress a context once, ask it many questions, keep it in a file: `kvpress.compress`, `kvpress.ask`,
`kvpress.load`.

A `CompressedContext` is a context's compressed cache, the model it belongs to, the policy that compressed it
(recorded as names and plain hyper-parameters, so it can be written down) and how questions follow it
(questions.py). Asking forks the cache (its tensors are shared, it never changes) and extends the fork with the
questions, left-padded to one batch, under the same policy; the answers are what asking each alone gives.

The file (context_file.py) is safetensors, nothing executed on load; a file for another model, another tokenizer,
with a damaged byte, or holding what no cache of the model holds is refused, saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import context_file
from .cache import KVPressCache, KVPressLayer
from .context_file import policy_from_spec, policy_spec, tokenizer_fingerprint
from .integrations.scoped import patched_for_call
from .integrations.hf import attention_modules_of, with_cache
from .policies.registry import resolve_policy
from .progress import per_forward, reporting, task
from .questions import QuestionFormat, left_padded, split_prompt, stop_ids


class TokenClock:
    """A generate() streamer that timestamps each put(): the first is the prompt, then one per generated step
    (each advancing `steps`, a progress task)."""

    def __init__(self, steps=None):
        self.stamps: list[float] = []
        self.steps = steps

    def put(self, value):
        self.stamps.append(time.perf_counter())
        if self.steps is not None and len(self.stamps) > 1:
            self.steps.advance()

    def end(self):
        pass


@dataclass
class Answers:
    """What `ask` returns: the answers, and what they cost."""

    questions: list[str]
    answers: list[str]
    token_ids: list[list[int]]  # each answer's generated ids, up to (without) its stop token
    context_tokens: int
    context_bytes: int  # bytes the compressed context holds (every stored tensor)
    full_cache_bytes: int  # bytes the same context holds in the full cache
    kept_fraction: float  # context tokens kept, averaged over compressed layers and KV heads
    question_s: float  # the questions' forward over the compressed context, up to each first answer token
    decode_s: float  # the decoding steps after the first token (all questions at once, batch_size at a time)
    decode_steps: int
    batches: int  # generate calls the questions took
    compress_s: float | None = None  # set by kvpress.ask (compress + ask in one call)
    shared_bytes: int = 0  # the model's tables the context's storage reads (CommVQ's codebooks), not in context_bytes
    # the most a batch's cache held, at the end of its answers: the context once (its rows share it), and each row's
    # question and answer
    batch_bytes: int = 0

    @property
    def bytes_fraction(self) -> float:
        return self.context_bytes / self.full_cache_bytes

    def __iter__(self):
        return iter(self.answers)

    def __len__(self):
        return len(self.answers)

    def __getitem__(self, i):
        return self.answers[i]


class CompressedContext:
    """A context compressed once (see the module docstring). `cache` is never run: `fork()` gives a runnable copy."""

    def __init__(self, model, cache: KVPressCache, context_ids: torch.Tensor, policy: list[dict],
                 question_format: QuestionFormat, tokenizer_id: str, compress_s: float | None = None):
        self.model, self.cache, self.context_ids = model, cache, context_ids
        self.policy, self.question_format, self.tokenizer_id = policy, question_format, tokenizer_id
        self.compress_s = compress_s

    # -- what it holds
    @property
    def context_tokens(self) -> int:
        return self.context_ids.shape[1]

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def full_cache_nbytes(self) -> int:
        """What the full cache of this context holds: every compressed layer at all its tokens, in its dtype."""
        total = 0
        for layer in self.cache.layers:
            if isinstance(layer, KVPressLayer) and layer.is_initialized:
                keys, values = layer.tail.data.keys, layer.tail.data.values
                per_head = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
                tokens = layer.seen if layer.prefix is None else layer.prefix.full_tokens + layer.seen - layer.prefix.seen
                total += tokens * keys.shape[0] * keys.shape[1] * per_head  # tokens x rows x KV heads
            elif getattr(layer, "is_initialized", False):
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total

    def kept_fraction(self) -> float:
        kept = seen = 0
        for _, layer in self.cache.kvpress_layers():
            if layer.is_initialized:
                counts = layer.tokens_per_head() + (0 if layer.prefix is None else layer.prefix.tokens_per_head())
                kept += int(counts.sum())
                seen += layer.seen * counts.numel()
        return kept / seen if seen else 1.0

    def fork(self) -> KVPressCache:
        return self.cache.fork()

    def make_policy(self, tokenizer=None):
        return policy_from_spec(self.policy, tokenizer)

    # -- asking
    def ask(self, tokenizer, questions, max_new_tokens: int = 64, batch_size: int | None = None,
            progress=True) -> Answers:
        """Greedy answers to `questions` (a string or a list), `batch_size` at a time (None: all at once; one at a
        time on models with sliding-window layers). Each answer is what asking that question alone gives.
        `progress`: True (decode steps on stderr, after 2 s), False, or a callable (kvpress/progress.py)."""
        with reporting(progress):
            return self._ask(tokenizer, questions, max_new_tokens, batch_size)

    def _ask(self, tokenizer, questions, max_new_tokens: int, batch_size: int | None) -> Answers:
        questions = [questions] if isinstance(questions, str) else questions
        if not isinstance(questions, (list, tuple)) or not questions:
            raise ValueError(f"questions={questions!r:.80}; allowed values: a non-empty string or list of strings")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}; allowed values: an int >= 1")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r}; allowed values: None (all questions at once) or an int >= 1")
        check_tokenizer(tokenizer)
        if tokenizer_fingerprint(tokenizer) != self.tokenizer_id:
            raise ValueError("tokenizer: not the tokenizer this context was compressed with (its ids or chat template "
                             "differ); allowed: the same tokenizer")
        ids = [self.question_format.ids(tokenizer, q) for q in questions]  # every question checked first
        stop = stop_ids(self.model, tokenizer)
        pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else min(stop, default=0)
        step = batch_size or len(ids)
        if any(not isinstance(layer, KVPressLayer) for layer in self.cache.layers) or \
                not self.make_policy(tokenizer).batches_questions:
            # a stock sliding-window layer (Gemma-3) windows by slot, and so do a read view's pages: a question's
            # left padding would take places in them. These answer one question at a time, what asking alone means
            step = 1
        tokens, question_s, decode_s, steps, batches, held = [], 0.0, 0.0, 0, 0, 0
        starts = range(0, len(ids), step)
        with task("answering", total=len(starts) * max_new_tokens, unit="step") as decoding:
            for start in starts:
                batches += 1
                batch_tokens, times = self._generate(ids[start:start + step], max_new_tokens, stop, pad, tokenizer,
                                                     decoding)
                tokens += batch_tokens
                question_s, decode_s, steps = question_s + times[0], decode_s + times[1], steps + times[2]
                held = max(held, times[3])
        answers = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
        return Answers(list(questions), answers, tokens, self.context_tokens, self.nbytes(), self.full_cache_nbytes(),
                       self.kept_fraction(), question_s, decode_s, steps, batches,
                       shared_bytes=self.cache.shared_nbytes(), batch_bytes=held)

    @torch.no_grad()
    def _generate(self, questions: list[list[int]], max_new_tokens: int, stop: set, pad: int, tokenizer, decoding):
        model = self.model
        ids, mask = left_padded(self.context_ids, questions, pad)
        device = context_file.model_device(model)
        cache = self.cache.fork()
        cache.share_context()  # the context once for every question (cache/prefix.py), each row its own tokens
        cache.batch_repeat_interleave(len(questions))
        clock = TokenClock(decoding)
        with patched_for_call(model, self.make_policy(tokenizer)):
            start = time.perf_counter()
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                 eos_token_id=sorted(stop) or None, streamer=clock, **with_cache(model, cache))
        new = out[:, ids.shape[1]:].tolist()
        tokens = []
        for row in new:
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            tokens.append(row[:cut])
        first = clock.stamps[1] if len(clock.stamps) > 1 else time.perf_counter()
        return tokens, (first - start, clock.stamps[-1] - first, max(len(clock.stamps) - 2, 0), cache.nbytes())

    # -- keeping
    def save(self, path) -> Path:
        """Write this context to `path` (safetensors, context_file.py). Returns the path."""
        return context_file.write(path, self.model, self.cache, self.context_ids, self.policy, self.question_format,
                                  self.tokenizer_id, self.compress_s)


def check_tokenizer(tokenizer) -> None:
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))) or \
            isinstance(tokenizer, (str, bytes)):
        raise ValueError(f"tokenizer={tokenizer!r:.60}; allowed values: the model's tokenizer (an object with encode "
                         f"and decode, e.g. transformers.AutoTokenizer.from_pretrained(path))")


# What `compress` and `ask` use when no policy is named: the best configuration measured within a tenth of the full
# cache's bytes (README "accuracy per byte", docs/results/frontier_seed): on SmolLM2's RULER-style suite it keeps 92%
# of the full cache's score at 9.4% of its bytes. kvzap reads a calibration shipped for SmolLM2 and Gemma-3; for
# another model `kvpress calibrate --model PATH` fits it once.
DEFAULT_POLICY = "kvzap+kivi"
DEFAULT_PARAMS = dict(compression_ratio=0.75, bits=4, residual_length=32)


def default_policy(policy, params: dict) -> tuple:
    """(policy, params) with the defaults above filled in where `policy` is None; a budget replaces the ratio."""
    if policy is not None:
        return policy, params
    defaults = {k: v for k, v in DEFAULT_PARAMS.items() if not (k == "compression_ratio" and "budget" in params)}
    return DEFAULT_POLICY, {**defaults, **params}


def compress(model, tokenizer, context: str, policy=None, *, chat_template: bool | None = None,
             prefill_chunk_size: int | None = None, progress=True, **params) -> CompressedContext:
    """Compress `context` once with `policy` (a name, composition or Policy; `params` its hyper-parameters, e.g.
    compression_ratio=0.75, bits=4; None: DEFAULT_POLICY with DEFAULT_PARAMS, which `params` override). Questions
    asked later never reach the compressor: pick a query-agnostic policy (kvzap, kvzip, keydiff, expected_attention,
    or one of them + kivi). `progress`: True (the prefill's layers on stderr, after 2 s), False, or a callable
    (kvpress/progress.py)."""
    with reporting(progress):
        return _compress(model, tokenizer, context, policy, chat_template, prefill_chunk_size, params)


def _compress(model, tokenizer, context: str, policy, chat_template, prefill_chunk_size, params) -> CompressedContext:
    check_tokenizer(tokenizer)
    context_ids, fmt = split_prompt(tokenizer, context, chat_template)  # (the context is checked before the policy)
    policy, params = default_policy(policy, params)
    spec = policy_spec(resolve_policy(policy, **params))
    cache = KVPressCache(model.config)
    layers = attention_modules_of(model)
    passes = 1 if not prefill_chunk_size else -(-context_ids.shape[1] // prefill_chunk_size)
    with patched_for_call(model, policy_from_spec(spec, tokenizer), prefill_chunk_size=prefill_chunk_size), \
            task("prefill", total=len(layers) * passes, unit="layer") as prefill, per_forward(layers, prefill):
        start = time.perf_counter()
        with torch.no_grad():
            ids = context_ids.to(context_file.model_device(model))
            model(**with_cache(model, cache, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                               logits_to_keep=1))
        elapsed = time.perf_counter() - start
    return CompressedContext(model, cache, context_ids, spec, fmt, tokenizer_fingerprint(tokenizer), elapsed)


def ask(model, tokenizer, context: str, questions, policy=None, *, max_new_tokens: int = 64,
        batch_size: int | None = None, chat_template: bool | None = None, progress=True, **params) -> Answers:
    """compress(model, tokenizer, context, policy, **params).ask(tokenizer, questions, max_new_tokens)."""
    compressed = compress(model, tokenizer, context, policy, chat_template=chat_template, progress=progress, **params)
    answers = compressed.ask(tokenizer, questions, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress)
    answers.compress_s = compressed.compress_s
    return answers


def load(path, model) -> CompressedContext:
    """The context `save` wrote to `path`, for `model`: refused (ValueError, saying why) when the file is not a
    kvpress context, is damaged, was made by another model or in another dtype, or holds what no cache of this model
    holds (context_file.py checks every field and tensor before anything is built)."""
    return loaded(context_file.read(path, model), model)


def loaded(saved: context_file.Saved, model) -> CompressedContext:
    """The context a checked file holds (context_file.read, or OpenedFile.for_model), for `model`."""
    return CompressedContext(model, saved.cache, saved.context_ids, saved.policy, saved.question_format,
                             saved.tokenizer_id, saved.compress_s)
