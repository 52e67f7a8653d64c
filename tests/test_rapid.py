"""RAPID (docs/policies.md 12.6): BM25 retrieval by its formula written here; greedy output equals plain greedy over
the whole prompt (the standard acceptance rule is lossless); a draft that reads the whole context is accepted
throughout; sampling hands the lossless rule the target's and the draft's own distributions; bad input is refused before anything runs."""

import math

import pytest
import torch

import kvpress
from kvpress.speculative import bm25_chunks, rapid_generate
from kvpress.speculative import rapid as rapid_module

from conftest import greedy, tiny_model


def _bm25(chunks, question, k1=1.5, b=0.75):
    average = sum(len(c) for c in chunks) / len(chunks)
    scores = []
    for chunk in chunks:
        total = 0.0
        for term in set(question):
            holding = sum(term in c for c in chunks)
            idf = math.log((len(chunks) - holding + 0.5) / (holding + 0.5) + 1)
            f = chunk.count(term)
            total += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * len(chunk) / average))
        scores.append(total)
    return scores


def test_retrieval_is_bm25_over_token_ids_in_document_order():
    g = torch.Generator().manual_seed(0)
    context = torch.randint(3, 60, (250,), generator=g)
    question = torch.tensor([5, 7, 7, 11, 42])
    chunks = [c.tolist() for c in context.split(16)]
    scores = _bm25(chunks, question.tolist())
    best = sorted(range(len(chunks)), key=lambda i: (-scores[i], i))[:4]
    assert bm25_chunks(context, question, 16, 4) == sorted(best)
    assert bm25_chunks(context, question, 16, 100) == list(range(len(chunks)))


def _case(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, 300), generator=g), torch.randint(3, 128, (1, 12), generator=g)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_is_plain_greedy_over_the_whole_prompt(gamma):
    model = tiny_model("llama")
    context, question = _case()
    ref = greedy(model, torch.cat([context, question], 1), 24, eos_token_id=[])
    out, stats = rapid_generate(model, context, question, chunk_size=32, gamma=gamma, max_new_tokens=24,
                                eos_token_id=[], return_stats=True)
    assert out.tolist() == ref.tolist()
    assert stats.emitted == 24 and stats.drafted > 0


def test_a_draft_over_the_whole_context_is_accepted_throughout():
    model = tiny_model("llama")
    context, question = _case(2)
    _, stats = rapid_generate(model, context, question, chunk_size=30, draft_tokens=300, gamma=4, max_new_tokens=20,
                              eos_token_id=[], return_stats=True)
    assert stats.accepted == stats.drafted


def test_sampling_pairs_the_drafts_distribution_with_the_targets(monkeypatch):
    """The lossless rule (speculative.accept, whose output distribution tests/test_speculative.py checks) is given the
    target's distributions over the whole prompt and the draft's over the retrieved chunks + question, computed here
    from the model directly."""
    model = tiny_model("llama")
    context, question = _case(3)
    calls = []
    real = rapid_module.accept
    monkeypatch.setattr(rapid_module, "accept", lambda p, q, d, generator=None: calls.append((p, q, d)) or
                        real(p, q, d, generator))
    out = rapid_generate(model, context, question, chunk_size=32, draft_tokens=64, gamma=3, max_new_tokens=5,
                         do_sample=True, temperature=0.7, eos_token_id=[], generator=torch.Generator().manual_seed(1))
    p, q, d = calls[0]
    prompt = torch.cat([context, question], 1)
    first = out[:, prompt.shape[1]:prompt.shape[1] + 1]
    keep = bm25_chunks(context[0], question[0], 32, 2)
    draft_prompt = torch.cat([context[:, 32 * i:32 * (i + 1)] for i in keep] + [question, first], 1)
    with torch.no_grad():
        target = (model(torch.cat([prompt, first, d], 1)).logits[0, -4:] / 0.7).softmax(-1)
        draft = (model(torch.cat([draft_prompt, d[:, :2]], 1)).logits[0, -3:] / 0.7).softmax(-1)
    torch.testing.assert_close(p[0], target, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(q[0], draft, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(q[0], target[:3], atol=1e-3)  # the draft's context is not the target's


@pytest.mark.parametrize("kwargs, match", [
    (dict(context_ids=torch.ones(2, 10, dtype=torch.long)), r"context_ids: \(2, 10\); allowed values: a tensor of token "
                                                             r"ids \[1, n\]"),
    (dict(chunk_size=0), r"chunk_size=0; allowed values: an int >= 1"),
    (dict(gamma=0), r"gamma=0; allowed values: an int >= 1"),
    (dict(draft_tokens=5000), r"draft_tokens=5000; allowed values: None \(a tenth of the context\) or an int in 1..300"),
    (dict(do_sample=True, temperature=0.0), r"temperature=0.0; allowed values: a float > 0"),
])
def test_bad_input_is_refused(kwargs, match):
    model = tiny_model("llama")
    context, question = _case()
    args = {"context_ids": context, "question_ids": question, **kwargs}
    with pytest.raises(ValueError, match=match):
        rapid_generate(model, args.pop("context_ids"), args.pop("question_ids"), **args)


def test_a_patched_model_is_refused():
    model = tiny_model("llama")
    context, question = _case()
    with kvpress.patch_model(model, "none"):
        with pytest.raises(ValueError, match=r"model: patched by kvpress; .* allowed: an unpatched model"):
            rapid_generate(model, context, question)


def test_retrieval_scores_against_query_ids_when_given(monkeypatch):
    model = tiny_model("llama")
    context, question = _case()
    seen = []
    real = rapid_module.bm25_chunks
    monkeypatch.setattr(rapid_module, "bm25_chunks", lambda c, q, *a: seen.append(q.tolist()) or real(c, q, *a))
    rapid_generate(model, context, question, chunk_size=32, max_new_tokens=2)
    rapid_generate(model, context, question, chunk_size=32, max_new_tokens=2, query_ids=torch.tensor([[9, 10]]))
    assert seen == [question[0].tolist(), [9, 10]]
    with pytest.raises(ValueError, match=r"query_ids: \(2,\); allowed values: a tensor of token ids \[1, n\]"):
        rapid_generate(model, context, question, query_ids=torch.tensor([9, 10]))
