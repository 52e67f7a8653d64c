"""Tests on real weights (prepared by `make models`): SmolLM2-135M-Instruct and Gemma-3-270M."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressCache
from kvpress.models import load
from kvpress.needle import needle_prompt

from conftest import greedy, record_held_tokens

pytestmark = pytest.mark.real_model


def chat(tokenizer, text):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids


def test_smollm2_none_is_token_identical(smollm2):
    model, tok = smollm2
    ids = chat(tok, "Write two sentences about the sea.")
    ref = greedy(model, ids, 24)
    with kvpress.patch_model(model, "none"):
        assert torch.equal(greedy(model, ids, 24), ref)
    assert torch.equal(greedy(model, ids, 24), ref)


def test_gemma3_none_is_token_identical():
    model, tok = load("gemma3")  # a base model: no chat template
    ids = tok("The three primary colours are", return_tensors="pt").input_ids
    ref = greedy(model, ids, 12)
    with kvpress.patch_model(model, "none"):
        assert torch.equal(greedy(model, ids, 12), ref)


PROMPTS = [
    "Summarise in one sentence: the committee met on Tuesday to discuss the budget for the new library, "
    "agreed to fund the roof repairs first, and postponed the decision on the reading room furniture.",
    "What is the capital of France? Answer briefly.",
    "List the planets of the solar system in order from the sun, then say which one is the largest and why "
    "astronomers call it a gas giant. Keep it short, and mention one of its moons. " * 2,
]


@pytest.mark.parametrize("policy,params", [("none", {}), ("snapkv", dict(compression_ratio=0.5, window_size=8))])
def test_left_padded_batch_equals_prompts_run_alone(smollm2, policy, params):
    model, tok = smollm2
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    n = 10
    with kvpress.patch_model(model, policy, **params):
        batch_cache = KVPressCache(model.config)
        out = model.generate(**batch, cache=batch_cache, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        width = batch.input_ids.shape[1]
        for row, text in enumerate(texts):
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            alone_cache = KVPressCache(model.config)
            alone = model.generate(ids, attention_mask=torch.ones_like(ids), cache=alone_cache,
                                   max_new_tokens=n, min_new_tokens=n, do_sample=False)
            assert out[row, width:].tolist() == alone[0, ids.shape[1]:].tolist(), f"row {row}"
            # the row kept exactly the tokens it keeps alone (shifted by its padding), in every layer and head
            pad = width - ids.shape[1]
            for layer_b, layer_a in zip(batch_cache.layers, alone_cache.layers):
                valid = layer_b.key_valid()[row]
                kept_b = [sorted((layer_b.key_positions()[row, h][valid[h]] - pad).tolist()) for h in range(valid.shape[0])]
                kept_a = [sorted(layer_a.key_positions()[0, h].tolist()) for h in range(valid.shape[0])]
                assert kept_b == kept_a, f"row {row}"


def _answer(model, tok, prompt):
    out = greedy(model, prompt.input_ids, 8)
    return tok.decode(out[0, prompt.n_tokens:], skip_special_tokens=True)


def test_snapkv_half_cache_still_finds_the_needle_at_4k(smollm2):
    model, tok = smollm2
    prompt = needle_prompt(tok, 4000, depth=0.4, seed=1)
    assert prompt.answer in _answer(model, tok, prompt)  # the full cache answers
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        answer = _answer(model, tok, prompt)
    stats = kvpress.last_cache_stats(model)
    assert prompt.answer in answer
    assert all(row["kept_max"] <= prompt.n_tokens // 2 + 8 for row in stats["layers"])


def test_chunked_prefill_hears_the_question_and_keeps_an_early_needle_at_3k(smollm2):
    """3K prompt fed in 1K chunks, SnapKV at 75% after every chunk: judged by its own queries, the first chunk drops
    the needle (depth 0.1); with the prompt's last 40 tokens declared the question, each chunk is judged with the
    question's queries appended and the needle is answered. No layer ever held more than budget + one chunk +
    the question, and the question's tokens were never kept beyond the prompt's own."""
    model, tok = smollm2
    prompt = needle_prompt(tok, 3000, depth=0.1, seed=3)
    budget = prompt.n_tokens - int(prompt.n_tokens * 0.75)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.75, prefill_chunk_size=1024):
        assert prompt.answer not in _answer(model, tok, prompt)
    with record_held_tokens() as peak, kvpress.patch_model(model, "snapkv", compression_ratio=0.75,
                                                             prefill_chunk_size=1024, question_tokens=40):
        answer = _answer(model, tok, prompt)
    assert prompt.answer in answer
    assert max(peak) <= budget + 1024 + 40
    stats = kvpress.last_cache_stats(model)
    assert all(row["kept_max"] <= budget + 8 for row in stats["layers"])  # + the generated tokens


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "not met: at 8K, chunked SnapKV 0.75 with the question appended to each chunk finds the needle in 1 of the 7 "
    "prompts (seeds 1-10, depth 0.1) that the full cache answers; one-shot SnapKV 0.75 finds 3 of 4 of them. Later "
    "chunks computed over a past with holes lose it even when the needle, the sinks and the question are kept "
    "(docs/results/chunked_drift)"))
def test_chunked_prefill_with_the_question_keeps_an_early_needle_at_8k(smollm2):
    """The same at 8K (the target of the calibrated-selection issue), on a prompt that one-shot SnapKV at 0.75 answers
    (seed 5; the full cache cannot answer seeds 1, 4 and 7): fails today (strict xfail). A one-shot miss would
    raise RuntimeError, which the xfail does not absorb."""
    model, tok = smollm2
    prompt = needle_prompt(tok, 8000, depth=0.1, seed=5)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.75):
        if prompt.answer not in _answer(model, tok, prompt):
            raise RuntimeError("one-shot SnapKV 0.75 no longer answers this prompt: the test's premise is gone")
    budget = prompt.n_tokens - int(prompt.n_tokens * 0.75)
    with record_held_tokens() as peak, kvpress.patch_model(model, "snapkv", compression_ratio=0.75,
                                                             prefill_chunk_size=1024, question_tokens=40):
        answer = _answer(model, tok, prompt)
    assert max(peak) <= budget + 1024 + 40
    assert prompt.answer in answer


def _document_and_question(tok, prompt):
    """The needle prompt split where its question starts: (document ids [1, n], question ids [1, m])."""
    text = tok.decode(prompt.input_ids[0])
    cut = text.rindex("\n\nQUESTION")
    encode = lambda part: tok(part, return_tensors="pt", add_special_tokens=False).input_ids  # noqa: E731
    return encode(text[:cut]), encode(text[cut:])


@pytest.mark.parametrize("policy, params", [("kvzap", dict(compression_ratio=0.75)),
                                            ("duo_attention", dict(streaming_heads=0.5))])
def test_calibrated_policies_answer_a_question_asked_after_compression(smollm2, policy, params):
    """The document is compressed alone (the question comes later, on a fork of the cache), with the calibration
    file `make models` installs beside SmolLM2: the needle is still answered, and the cache holds what the policy
    promises (kvzap: 25% of the K/V tokens; the head split: about half)."""
    model, tok = smollm2
    prompt = needle_prompt(tok, 3000, depth=0.3, seed=5)
    document, question = _document_and_question(tok, prompt)
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        model(document, cache=cache)
        kept = sum(int(layer.tokens_per_head().sum()) for _, layer in cache.kvpress_layers())
        full = document.shape[1] * 3 * len(cache.kvpress_layers())  # 3 KV heads
        ids = torch.cat([document, question], 1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache.fork(), max_new_tokens=8,
                             do_sample=False)
    assert prompt.answer in tok.decode(out[0, ids.shape[1]:])
    if policy == "kvzap":
        assert kept == (document.shape[1] - math.ceil(document.shape[1] * 0.75)) * 3 * len(cache.kvpress_layers())
    else:
        assert 0.45 < kept / full < 0.6


def test_gemma3_reads_its_shipped_codebooks_and_less_maps():
    """The calibration shipped for Gemma-3 carries CommVQ's codebooks and LESS's maps for its 3 global-attention
    layers (the ones kvpress compresses): commvq stores their prompt as codes (its default read, 16 of the 20 shipped
    stages: 1.5 bits per number, 48 bytes and a 2-byte norm of a bf16 vector's 512; its full-precision window's
    buffer is most of the rest at this length) and still gives a needle buried in the text; less keeps its low-rank
    state there."""
    model, tok = load("gemma3")
    filler = "The grass is green and the river flows north past the old stone bridge. " * 40
    text = filler + "The secret code is 7394021. " + filler + "What is the secret code? The secret code is"
    ids = tok(text, return_tensors="pt").input_ids
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, "commvq"), torch.no_grad():  # its defaults: 16-token window and blocks
        out = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache)  # a digit a token
    assert "7394021" in tok.decode(out[0, ids.shape[1]:])
    layers = cache.kvpress_layers()
    assert [i for i, _ in layers] == [5, 11, 17]
    slots = ids.shape[1] + 9
    full = slots * (2 * 256 * model.dtype.itemsize + 4)  # one KV head of 256: keys, values, an int32 position
    assert all(layer.nbytes() < 0.2 * full for _, layer in layers)
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, "less", compression_ratio=0.5), torch.no_grad():
        model(ids, cache=cache)
    assert all(layer.policy_stats for _, layer in cache.kvpress_layers())
