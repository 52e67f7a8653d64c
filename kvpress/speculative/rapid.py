"""RAPID (Chen et al. 2025, "Long-Context Inference with Retrieval-Augmented Speculative Decoding"): the model drafts
over a short context, the chunks of the long one most relevant to the question, and verifies against the whole.

The draft is the same model with a cache of its own, prefilled with the retrieved chunks (in document order) and the
question at its own positions; the target is the model over the whole context and the question. Each round the draft
proposes `gamma` tokens, one target forward checks them, and both caches are cut back to what was accepted.

Acceptance is the standard speculative rule, which is lossless: greedy drafts are kept while they equal the target's
argmax; sampled drafts are kept with probability min(1, p/q) and the first rejection is resampled from
normalize(max(0, p - q)), so the output follows the target alone (the same rule as speculative_generate). RAPID's
paper also pulls acceptance toward the draft (a "retrieval-augmented target", its margin eta > 0); that rule is not
lossless and is not offered here (with eta = 0 the paper's rule is this one).

Differences from the official code (John-AI-Lab/RAPID@22d41f4), named: retrieval is BM25 over token ids (the official
code embeds chunks with BGE-M3, a model this library cannot download) with the "+1" IDF (never negative), k1 = 1.5,
b = 0.75; the top chunks by score fill `draft_tokens` (no score threshold, which has no scale-free meaning for BM25);
the draft's context defaults to a tenth of the context (the official evaluation retrieves 1/32, at least 4096 tokens,
sized for 128K contexts); one row at a time, as the official code.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..integrations.hf import with_cache
from ..integrations.registry import patch_of
from .stats import SpeculativeStats, clock
from .sampling import accept, check_sampling, pick_token, sampling_distribution


def bm25_chunks(context: torch.Tensor, question: torch.Tensor, chunk_size: int, n_chunks: int,
                k1: float = 1.5, b: float = 0.75) -> list[int]:
    """Indices of the `n_chunks` chunks of `chunk_size` tokens of context ids [L] that score highest by BM25 against
    question ids [Lq] (terms: token ids; ties go to the earlier chunk), in document order."""
    chunks = list(context.split(chunk_size))
    average = sum(len(c) for c in chunks) / len(chunks)
    terms = question.unique()
    counts = torch.stack([(c[:, None] == terms).sum(0) for c in chunks]).double()  # [n, terms]
    holding = (counts > 0).sum(0)
    idf = torch.log((len(chunks) - holding + 0.5) / (holding + 0.5) + 1)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.float64, device=context.device)[:, None]
    score = (idf * counts * (k1 + 1) / (counts + k1 * (1 - b + b * lengths / average))).sum(-1)
    order = sorted(range(len(chunks)), key=lambda i: (-float(score[i]), i))
    return sorted(order[:n_chunks])


@torch.no_grad()
def rapid_generate(model, context_ids: torch.Tensor, question_ids: torch.Tensor, *, chunk_size: int = 128,
                   draft_tokens: int | None = None, gamma: int = 10, max_new_tokens: int = 64, do_sample: bool = False,
                   temperature: float = 1.0, top_p: float = 1.0, eos_token_id=None, generator=None,
                   query_ids: torch.Tensor | None = None, return_stats: bool = False):
    """Generate the answer to `question_ids` [1, Lq] about `context_ids` [1, L] (the prompt is context + question, as
    the target sees it), drafting from the `draft_tokens` context tokens BM25 finds for the question (default: a
    tenth of the context, at least one chunk). query_ids [1, n]: what retrieval scores the chunks against (default:
    question_ids; give the question's own words when question_ids carries a chat template's tokens, which would
    otherwise pull in the chunk holding the template's start). Returns ids [1, L + Lq + new] like `generate` (and
    SpeculativeStats with return_stats=True). The model must be unpatched: both caches are transformers' own."""
    _check(model, context_ids, question_ids, query_ids, chunk_size, draft_tokens, gamma, max_new_tokens, do_sample,
           temperature, top_p)
    length = context_ids.shape[1]
    budget = draft_tokens if draft_tokens is not None else max(chunk_size, length // 10)
    query = question_ids if query_ids is None else query_ids
    keep = bm25_chunks(context_ids[0], query[0], chunk_size, max(1, budget // chunk_size))
    pieces = list(context_ids[0].split(chunk_size))
    draft_prompt = torch.cat([*(pieces[i] for i in keep), question_ids[0]])[None]
    prompt = torch.cat([context_ids, question_ids], 1)
    eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    def pick(logits):
        return pick_token(logits, do_sample, temperature, top_p, generator)

    stats, start = SpeculativeStats(), clock(prompt.device)
    target, draft = DynamicCache(config=model.config), DynamicCache(config=model.config)
    token, _ = pick(model(**with_cache(model, target, input_ids=prompt)).logits[:, -1])
    model(**with_cache(model, draft, input_ids=draft_prompt))
    stats.prefill_s = clock(prompt.device) - start
    out, unseen = [int(token)], [int(token)]  # unseen: tokens the draft's cache has not read yet
    while len(out) < max_new_tokens and out[-1] not in eos:
        g = min(gamma, max_new_tokens - len(out) - 1)
        t_draft = clock(prompt.device)
        drafts, q_probs, feed = [], [], unseen
        for _ in range(g):
            ids = torch.tensor([feed], device=prompt.device)
            d, q = pick(model(**with_cache(model, draft, input_ids=ids)).logits[:, -1])
            drafts.append(int(d))
            q_probs.append(q)
            feed = [int(d)]
        t_verify = clock(prompt.device)
        stats.draft_s += t_verify - t_draft
        d = torch.tensor([drafts], dtype=torch.long, device=prompt.device)
        ids = torch.cat([prompt.new_tensor([[out[-1]]]), d], 1)
        logits = model(**with_cache(model, target, input_ids=ids)).logits  # [1, g + 1, V]
        if do_sample:
            q = torch.stack(q_probs, 1) if g else logits.new_zeros(1, 0, logits.shape[-1])
            n, nxt = accept(sampling_distribution(logits, temperature, top_p), q, d, generator)
        else:
            n, nxt = accept(logits, None, d)
        k = int(n)
        _drop(target, g - k)  # keeps out[-1] and d_1..d_k
        if g:  # the draft read unseen + d_1..d_(g-1): keep what was accepted of it
            read = min(k, g - 1)
            _drop(draft, g - 1 - read)
            unseen = drafts[read:k] + [int(nxt)]
        else:
            unseen = unseen + [int(nxt)]
        stats.verify_s += clock(prompt.device) - t_verify
        emitted = drafts[:k] + [int(nxt)]
        stop = next((i for i, t in enumerate(emitted) if t in eos), None)
        out += emitted if stop is None else emitted[:stop + 1]
        stats.rounds += 1
        stats.drafted += g
        stats.accepted += k
        stats.per_round_accepted.append([k])
    new = prompt.new_tensor([out[:max_new_tokens]])
    stats.emitted = new.shape[1]
    stats.total_s = clock(prompt.device) - start
    result = torch.cat([prompt, new], 1)
    return (result, stats) if return_stats else result


def _drop(cache: DynamicCache, n: int) -> None:
    """Forget the cache's n newest tokens."""
    if n:
        cache.crop(-n)


def _check(model, context_ids, question_ids, query_ids, chunk_size, draft_tokens, gamma, max_new_tokens, do_sample,
           temperature, top_p) -> None:
    for name, ids in (("context_ids", context_ids), ("question_ids", question_ids), ("query_ids", query_ids)):
        if ids is None and name == "query_ids":
            continue
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or \
                ids.is_floating_point() or ids.dtype == torch.bool:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"{name}: {shape}; allowed values: a tensor of token ids [1, n], n >= 1 (one row at a "
                             f"time)")
    for name, value in (("chunk_size", chunk_size), ("gamma", gamma), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}; allowed values: an int >= 1")
    whole = context_ids.shape[1]
    if draft_tokens is not None and (not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool)
                                     or not 1 <= draft_tokens <= whole):
        raise ValueError(f"draft_tokens={draft_tokens!r}; allowed values: None (a tenth of the context) or an int in "
                         f"1..{context_ids.shape[1]} (the context's length)")
    check_sampling(do_sample, temperature, top_p)
    if patch_of(model) is not None:
        raise ValueError("model: patched by kvpress; rapid_generate runs the draft and the target on transformers' own "
                         "caches; allowed: an unpatched model (patch.unpatch() first)")
