"""Evaluate one sample under many (policy, ratio) configs, in either mode, and return one row per config and
question.

query_aware     the question is inside the compressed prompt (what `generate` sees): one prefill per question.
query_agnostic  the context is compressed first, with no question in sight; then each question extends that
                same compressed cache and is answered (the multi-turn / shared-document case).
"""

from __future__ import annotations

import torch

from kvpress.questions import stop_ids

from .engine import Config, answer, decode_batches, prefill
from .metrics import score_prediction
from .samples import Sample, encode

MODES = ("query_aware", "query_agnostic")


def _kv_bytes(cache) -> int:
    return sum(row["kv_bytes"] for row in cache.stats())


def evaluate(model, tokenizer, sample: Sample, configs: list[Config], mode: str = "query_aware",
             decode_alone: bool = False) -> list[dict]:
    """Rows of every config on `sample`. Configs decode stacked as rows of shared batches, so a row's decode_s is
    its batch's (`batch`: how many configs shared it), unless `decode_alone` (each config its own batch)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed values: {list(MODES)}")
    device = model.device
    max_tokens = sample.meta.get("max_tokens")
    encoded = [encode(tokenizer, sample, q, max_tokens) for q in sample.questions]
    stop = stop_ids(model, tokenizer)
    rows = []

    def record(pre, c, qi, tokens, decode_s, batch):
        q = sample.questions[qi]
        prediction = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(dict(
            task=sample.task, index=sample.index, length=sample.meta.get("target_length"),
            n_tokens=len(encoded[qi][0]) + len(encoded[qi][1]), mode=mode, policy=c.policy, ratio=c.ratio,
            question=qi, prediction=prediction, answers=q.answers,
            score=score_prediction(sample.metric, prediction, q.answers, sample.meta.get("all_classes"),
                                   sample.meta.get("first_line", False)),
            kv_bytes=_kv_bytes(pre.caches[c]), cache_bytes=pre.caches[c].nbytes(),
            prefill_s=round(pre.seconds[c], 4), decode_s=round(decode_s, 4), batch=batch, new_tokens=len(tokens),
            **{k: v for k, v in sample.meta.items() if k in ("depth", "seed")},
        ))

    if mode == "query_aware":
        for qi, (head, tail) in enumerate(encoded):
            pre = prefill(model, torch.tensor([head + tail], device=device), configs)
            for batch, policy in decode_batches(pre, configs, decode_alone):
                tokens, seconds = answer(model, pre, batch, policy, None, sample.max_new_tokens, stop)
                for c, t in zip(batch, tokens):
                    record(pre, c, qi, t, seconds, len(batch))
    else:
        if any(head != encoded[0][0] for head, _ in encoded):
            raise ValueError("query_agnostic: the questions of a sample must share one context")
        pre = prefill(model, torch.tensor([encoded[0][0]], device=device), configs)
        batches = decode_batches(pre, configs, decode_alone)
        for qi, (_, tail) in enumerate(encoded):
            for batch, policy in batches:
                tokens, seconds = answer(model, pre, batch, policy, torch.tensor([tail], device=device),
                                         sample.max_new_tokens, stop)
                for c, t in zip(batch, tokens):
                    record(pre, c, qi, t, seconds, len(batch))
    return rows
