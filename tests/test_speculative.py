"""Sparse reads and self-speculative decoding: losslessness, sampling correctness, rollback, kernels."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache
from kvpress.integrations.hf import with_cache
from kvpress.kernels import allowed_mask
from kvpress.kernels.online_softmax import Queries, finish
from kvpress.kernels.sparse_attention import Selection, sparse_attention_state_reference
from kvpress.kernels.triton_sparse import sparse_attention_state_triton
from kvpress.policies import Quest
from kvpress.speculative import DRAFTS, accept, custom_generate, last_stats, speculative_generate

from conftest import tiny_model

KINDS = sorted(set(DRAFTS) - {"quant4"})  # read-subset drafts; quant4 (a precision view) is tested apart
# lserve's streaming heads need the model's calibration file: tests/test_lserve.py drafts with one
# double_sparsity's label channels likewise (tests/test_double_sparsity.py): here the first 4 of the tiny models' 16
DRAFT_PARAMS = {"lserve": dict(static_sparsity=0.0, page_size=8, sub_pages=2),
                "double_sparsity": dict(dense_layers=1, channels={i: torch.arange(4).expand(4, 4) for i in (0, 1)}),
                "shadowkv": dict(chunk_size=4, local_chunks=2, outlier_chunks=2)}


def plain(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def left_padded_pair(seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(3, 128, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    ids[1, :17] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("draft", KINDS)
def test_greedy_speculative_equals_greedy_plain(arch, draft):
    model = tiny_model(arch)
    ids1 = torch.randint(3, 128, (1, 70))
    cases = [(ids1, torch.ones_like(ids1)), left_padded_pair()]
    for ids, mask in cases:
        ref = plain(model, ids, mask, 24)
        for gamma in (1, 3, 5):
            out = speculative_generate(model, ids, mask, draft=draft, gamma=gamma, max_new_tokens=24, draft_budget=16,
                                       eos_token_id=model.generation_config.eos_token_id,
                                       pad_token_id=model.generation_config.pad_token_id,
                                       **DRAFT_PARAMS.get(draft, {}))
            assert out.tolist() == ref.tolist(), (draft, gamma, ids.shape[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quant4_draft_is_lossless_against_the_8bit_kv_model(arch):
    """QuantSpec-style: the draft reads the upper 4 bits of the 8-bit codes the target reads in full; the
    reference is plain greedy decoding over the same 8-bit KIVI cache."""
    model = tiny_model(arch)
    ids1 = torch.randint(3, 128, (1, 70))
    codec = dict(group_size=16, residual_length=16)
    for ids, mask in [(ids1, torch.ones_like(ids1)), left_padded_pair(1)]:
        with kvpress.patch_model(model, "kivi", bits=8, **codec):
            ref = plain(model, ids, mask, 12)  # short enough that no group is flushed while generating
            for gamma in (1, 3, 5):
                out, stats = speculative_generate(model, ids, mask, draft="quant4", gamma=gamma, max_new_tokens=12,
                                                  return_stats=True)
                assert out.tolist() == ref.tolist(), gamma
        out = speculative_generate(model, ids, mask, draft="quant4", gamma=3, max_new_tokens=12, **codec)
        assert out.tolist() == ref.tolist()  # unpatched model: patched with 8-bit KIVI for the call


def test_speculative_rolls_back_over_a_codec_that_flushes_a_padded_batch_while_decoding():
    """Padding that cuts a KIVI group makes the codec's layers flat runs (each row grouped from its own first
    token); 40 new tokens flush groups between rounds, and rejected drafts are rolled back out of full-precision
    flat runs. Output equals plain greedy decoding over the same 8-bit cache."""
    model = tiny_model("llama")
    ids, mask = left_padded_pair(1)
    with kvpress.patch_model(model, "kivi", bits=8, group_size=16, residual_length=16):
        ref = plain(model, ids, mask, 40)
        for gamma in (2, 5):
            out = speculative_generate(model, ids, mask, draft="quant4", gamma=gamma, max_new_tokens=40)
            assert out.tolist() == ref.tolist(), gamma


def test_custom_generate_entry_point_and_patched_prefill_policy():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 60))
    ref = plain(model, ids, torch.ones_like(ids), 20)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                         custom_generate=custom_generate, draft="quest", gamma=3, draft_budget=16)
    assert out.tolist() == ref.tolist()
    # speculation over a SnapKV-compressed cache equals plain greedy over the same compressed cache
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4):
        ref = plain(model, ids, torch.ones_like(ids), 20)
        out = speculative_generate(model, ids, draft="sink_window", gamma=4, max_new_tokens=20, draft_budget=12)
    assert out.tolist() == ref.tolist()


def test_rollback_leaves_the_cache_as_if_rejected_tokens_never_came():
    model = tiny_model("llama")
    prompt, x, drafts = torch.randint(3, 128, (1, 40)), torch.tensor([[5]]), torch.tensor([[7, 8, 9]])
    with kvpress.patch_model(model, "none"):
        spec = KVPressCache(model.config)
        model(prompt, cache=spec)
        spec.read_policy = DRAFTS["retrieval"](budget=8, chunk_size=4, recent=4)
        for token in [x, drafts[:, :1], drafts[:, 1:2]]:  # draft steps write draft KV ...
            model(token, cache=spec)
        spec.read_policy = None
        spec.crop(-3)  # ... which is rolled back before verification
        model(torch.cat([x, drafts], 1), cache=spec)  # verify 1 + 3
        spec.crop(-2)  # one draft accepted: keep x, d1
        fresh = KVPressCache(model.config)
        model(torch.cat([prompt, x, drafts[:, :1]], 1), cache=fresh)
    for a, b in zip(spec.layers, fresh.layers):
        assert a.seen == b.seen == 42 and a.view_width == b.view_width == 42
        assert torch.equal(a.key_positions(), b.key_positions())
        torch.testing.assert_close(a.keys_view(), b.keys_view(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values_view(), b.values_view(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- stats and a prefilled cache
def _check_stats(stats, generated, gamma):
    for name in ("prefill_s", "draft_s", "verify_s", "total_s", "decode_s", "decode_tokens_per_s"):
        assert getattr(stats, name) >= 0, name
    assert stats.prefill_s + stats.draft_s + stats.verify_s <= stats.total_s
    assert stats.emitted == generated
    assert stats.rounds == len(stats.per_round_accepted) >= 1
    assert 1 <= stats.tokens_per_round <= gamma + 1 and 0 <= stats.acceptance_rate <= 1


def test_stats_split_the_time_and_count_the_returned_tokens():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no speculative_generate has finished on this model yet"):
        last_stats(model)
    ids, mask = left_padded_pair()
    out, stats = speculative_generate(model, ids, mask, draft="quest", gamma=3, max_new_tokens=20, draft_budget=16,
                                      return_stats=True)
    _check_stats(stats, out.shape[1] - ids.shape[1], 3)
    assert stats.emitted == 20 and last_stats(model) is stats
    # cut at EOS: emitted counts the returned tokens, not the drafts committed after the EOS
    eos = int(out[0, ids.shape[1] + 6])
    out, stats = speculative_generate(model, ids[:1], draft="quest", gamma=3, max_new_tokens=20, draft_budget=16,
                                      eos_token_id=eos, return_stats=True)
    assert int(out[0, -1]) == eos and out.shape[1] - ids.shape[1] <= 7
    _check_stats(stats, out.shape[1] - ids.shape[1], 3)
    # through model.generate, which returns ids only
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         custom_generate=custom_generate, draft="sink_window", gamma=2, draft_budget=16)
    _check_stats(last_stats(model), out.shape[1] - ids.shape[1], 2)


def test_decoding_from_a_prefilled_cache_equals_decoding_from_the_prompt():
    """One prefill of the prompt less its last tokens, forked for each call: every call equals plain greedy decoding
    and leaves the prefilled cache as it was."""
    model = tiny_model("llama")
    ids, mask = left_padded_pair(2)
    with kvpress.patch_model(model, "none"):
        ref = plain(model, ids, mask, 16)
        prefilled = KVPressCache(model.config)
        model(ids[:, :-3], **with_cache(model, prefilled, attention_mask=mask[:, :-3]))
        for draft in ("retrieval", "sink_window"):
            out, stats = speculative_generate(model, ids, mask, draft=draft, gamma=3, max_new_tokens=16,
                                              draft_budget=16, cache=prefilled.fork(), return_stats=True)
            assert out.tolist() == ref.tolist(), draft
            _check_stats(stats, 16, 3)
        assert prefilled.get_seq_length() == ids.shape[1] - 3
        fork = prefilled.fork()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             custom_generate=custom_generate, draft="quest", gamma=3, draft_budget=16, cache=fork)
        assert out.tolist() == ref.tolist()
        assert fork.get_seq_length() == out.shape[1] - 1  # generate's cache was the one decoded on
    from transformers import DynamicCache

    whole = KVPressCache(model.config)
    with kvpress.patch_model(model, "none"):
        model(ids, **with_cache(model, whole, attention_mask=mask))
    for past, match in [(whole, r"cache holds 70 tokens; allowed values: a KVPressCache holding fewer "
                                r"tokens than input_ids \(70\)"),
                        (DynamicCache(), r"cache=DynamicCache; allowed values: None, or a KVPressCache")]:
        with pytest.raises(ValueError, match=match):
            speculative_generate(model, ids, mask, cache=past)


# ---------------------------------------------------------------------------- sampling
def _emitted(p, q, n_draws, generator):
    """Token emitted at the first position by one round with g=1 (accepted draft, or the correction)."""
    P, Q = p.expand(n_draws, 2, -1), q.expand(n_draws, 1, -1)
    d = torch.multinomial(Q[:, 0], 1, generator=generator)
    n, nxt = accept(P, Q, d, generator)
    return torch.where(n == 1, d[:, 0], nxt)


@pytest.mark.parametrize("case", ["random", "equal", "q_misses_support", "top_p"])
def test_acceptance_rule_reproduces_the_target_distribution(case):
    gen = torch.Generator().manual_seed(0)
    V, N = 8, 400_000
    p = torch.rand(V, generator=gen) ** 3
    q = torch.rand(V, generator=gen) ** 3
    if case == "equal":
        q = p.clone()
    if case == "q_misses_support":
        q[:3] = 0
    p, q = p / p.sum(), q / q.sum()
    if case == "top_p":
        from kvpress.speculative.sampling import sampling_distribution

        p = sampling_distribution(torch.log(p), 1.0, 0.7)
        q = sampling_distribution(torch.log(q), 1.0, 0.7)
    p2 = torch.stack([p, p])[None]  # position 1 and bonus
    tokens = _emitted(p2, q[None, None], N, gen)
    empirical = torch.bincount(tokens, minlength=V).float() / N
    sigma = (p * (1 - p) / N).sqrt()
    assert ((empirical - p).abs() <= 4 * sigma + 1e-6).all(), (empirical, p)
    assert torch.allclose(torch.minimum(p, q) + (p - q).clamp(min=0), p)  # the closed form


def test_speculative_sampling_matches_plain_sampling_in_distribution():
    """20k rows of one prompt on a small-vocabulary model: tokens 2 and 3 (produced by speculative rounds,
    drafting from a 4-token view) are distributed like plain sampling's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper distributions, so the draft's differ visibly from the target's
    rows = 20_000
    ids = torch.randint(2, 12, (1, 24)).expand(rows, -1)
    kw = dict(temperature=0.9, top_p=0.95)
    torch.manual_seed(1)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=3, **kw)
    out, stats = speculative_generate(model, ids, draft="sink_window", gamma=2, max_new_tokens=3, do_sample=True,
                                      draft_budget=4, n_sink=1, generator=torch.Generator().manual_seed(2),
                                      return_stats=True, **kw)
    assert 0.05 < stats.acceptance_rate < 0.97  # the draft really differs from the target
    for col in (25, 26):
        a = torch.bincount(ref[:, col], minlength=12).float() / rows
        b = torch.bincount(out[:, col], minlength=12).float() / rows
        assert 0.5 * (a - b).abs().sum() < 0.03, (col, a, b)


# ---------------------------------------------------------------------------- kernels and selection
@pytest.mark.parametrize("B,HKV,G,R,T,K", [(1, 1, 1, 1, 40, 12), (2, 2, 4, 1, 90, 33), (1, 2, 3, 3, 64, 40),
                                           (1, 2, 4, 20, 64, 40)])  # 20 rows x 4: blocks of rows_per_call(4)
def test_sparse_gather_attention_equals_dense_restricted(B, HKV, G, R, T, K):
    torch.manual_seed(T)
    D = 32
    keys, values = torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D)
    positions = torch.arange(T).expand(B, HKV, T)
    idx = torch.stack([torch.randperm(T - R)[:K - R] for _ in range(B * HKV)]).view(B, HKV, -1)
    idx = torch.cat([idx, torch.arange(T - R, T).expand(B, HKV, R)], -1)  # the query's own slots
    ok = torch.rand(B, HKV, K) > 0.3  # ragged: some entries are padding
    ok[..., -R:] = True
    q, qpos = torch.randn(B, HKV * G, R, D), torch.arange(T - R, T)
    chosen = torch.zeros(B, HKV, T, dtype=torch.bool).scatter(-1, idx, ok)
    allowed = allowed_mask(qpos, positions, chosen).repeat_interleave(G, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1), attn_mask=allowed, scale=D ** -0.5)
    queries, selection = Queries(q, qpos, D ** -0.5), Selection(idx, ok)
    ref = sparse_attention_state_reference(queries, keys, values, positions, selection, block=7)
    torch.testing.assert_close(finish(ref, queries), dense, atol=1e-5, rtol=1e-5)
    tri = sparse_attention_state_triton(queries, keys, values, positions, selection, block_t=16, target_programs=4)
    torch.testing.assert_close(finish(tri, queries), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap, rows", [(None, None, 1), (20, None, 3), (None, 30.0, 2), (None, None, 6),
                                                   (20, 30.0, 7)])
def test_flat_runs_read_in_place_equal_dense_attention_per_head(window, softcap, rows):
    """A flat store of ragged per-(row, head) runs (one empty), read with a rectangular tail of newer slots (one
    invalid, some after the first query rows: causal), in place on CPU (a row's runs and tail in one masked softmax
    for up to 4 query rows, run by run beyond), equals a dense masked softmax over each head's own run + tail; a head
    with nothing readable keeps an empty state; and the Triton path over the same runs agrees."""
    from kvpress.kernels.sparse_attention import flat_attention_state

    torch.manual_seed(rows)
    B, HKV, G, D, TAIL = 2, 3, 2, 16, 4
    lengths = torch.tensor([[30, 0, 17], [5, 41, 23]])
    n = int(lengths.sum())
    keys, values = torch.randn(n, D), torch.randn(n, D)
    positions = torch.cat([torch.randperm(60)[:int(k)].sort().values for k in lengths.flatten()])
    starts = (lengths.flatten().cumsum(0) - lengths.flatten()).view_as(lengths)
    q, qpos = torch.randn(B, HKV * G, rows, D), torch.arange(60, 60 + rows) - 2
    queries = Queries(q, qpos, D ** -0.5, softcap, window)
    tail_k, tail_v = torch.randn(B, HKV, TAIL, D), torch.randn(B, HKV, TAIL, D)
    tail_pos = torch.tensor([55, 57, 59, 61]).expand(B, HKV, TAIL)
    tail_valid = torch.ones(B, HKV, TAIL, dtype=torch.bool)
    tail_valid[1, 2, 0] = False
    empty = flat_attention_state(queries, keys, values, positions, starts, lengths, use_triton=False)
    assert bool((empty[0][0, 1] == float("-inf")).all()) and bool((empty[1][0, 1] == 0).all())
    rect = (tail_k, tail_v, tail_pos, tail_valid)
    out = finish(flat_attention_state(queries, keys, values, positions, starts, lengths, use_triton=False, rect=rect),
                 queries)
    for b in range(B):
        for h in range(HKV):
            run = slice(int(starts[b, h]), int(starts[b, h] + lengths[b, h]))
            k = torch.cat([keys[run], tail_k[b, h]])
            v = torch.cat([values[run], tail_v[b, h]])
            pos = torch.cat([positions[run], tail_pos[b, h]])
            ok = torch.cat([torch.ones(int(lengths[b, h]), dtype=torch.bool), tail_valid[b, h]])
            logits = torch.einsum("grd,nd->grn", q[b, h * G:(h + 1) * G], k) * D ** -0.5
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            allowed = allowed_mask(qpos, pos.view(1, 1, -1), ok.view(1, 1, -1), window)[0, 0]
            probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G].nan_to_num(0.0), probs @ v, atol=1e-5, rtol=1e-5)
    if softcap is None:
        tri = finish(flat_attention_state(queries, keys, values, positions, starts, lengths, use_triton=True,
                                          rect=rect), queries)
        torch.testing.assert_close(tri.nan_to_num(0.0), out.nan_to_num(0.0), atol=1e-5, rtol=1e-5)


def test_quest_page_score_bounds_every_key_in_the_page():
    from kvpress.policies.sparse import page_stats
    from kvpress import KVPressLayer

    torch.manual_seed(0)
    for _ in range(20):
        layer = KVPressLayer()
        layer.update(torch.randn(1, 2, 70, 16) * 3, torch.randn(1, 2, 70, 16))
        stats = page_stats(layer, 16)
        q = torch.randn(1, 2, 1, 16)
        bound = torch.maximum(q * stats.kmax, q * stats.kmin).sum(-1)  # [1, 2, 5]
        dots = (layer.keys_view() * q).sum(-1)  # [1, 2, 70]
        padded = torch.nn.functional.pad(dots, (0, 80 - 70), value=float("-inf")).view(1, 2, 5, 16)
        assert (bound >= padded.amax(-1) - 1e-4).all()


def test_page_stats_follow_appends_and_rollback():
    from kvpress.policies.sparse import page_stats
    from kvpress import KVPressLayer

    layer = KVPressLayer()
    layer.update(torch.randn(1, 1, 37, 8), torch.randn(1, 1, 37, 8))
    page_stats(layer, 8)
    layer.update(torch.randn(1, 1, 9, 8), torch.randn(1, 1, 9, 8))
    layer.crop(-5)
    stats = page_stats(layer, 8)
    fresh = KVPressLayer()
    fresh.update(layer.keys_view().clone(), layer.values_view().clone())
    ref = page_stats(fresh, 8)
    assert torch.equal(stats.kmax, ref.kmax) and torch.equal(stats.kmin, ref.kmin)


def test_compare_times_plain_decoding_of_the_same_tokens_over_the_same_prefill():
    """compare=True: the stats carry plain decoding's time for as many tokens over a copy of the prefilled cache
    (the speedup is the ratio), and for greedy whether plain decoding gave the same tokens: it must."""
    model = tiny_model("llama")
    ids, mask = left_padded_pair()
    out, stats = speculative_generate(model, ids, mask, draft="quest", gamma=3, max_new_tokens=20, draft_budget=16,
                                      return_stats=True, compare=True)
    assert stats.plain_matches is True and stats.plain_decode_s > 0
    assert stats.speedup == pytest.approx(stats.plain_decode_s / stats.decode_s)
    assert out.tolist() == plain(model, ids, mask, 20).tolist()
    _, sampled = speculative_generate(model, ids, mask, draft="sink_window", gamma=2, max_new_tokens=8, do_sample=True,
                                      draft_budget=16, return_stats=True, compare=True,
                                      generator=torch.Generator().manual_seed(0))
    assert sampled.plain_matches is None and sampled.plain_decode_s > 0  # (sampled tokens differ; the cost does not)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, custom_generate=custom_generate,
                   draft="sink_window", gamma=2, draft_budget=16, compare=True)
    assert last_stats(model).plain_matches is True
    _, alone = speculative_generate(model, ids, mask, max_new_tokens=8, draft_budget=16, return_stats=True)
    assert alone.plain_decode_s is None and alone.speedup is None  # not asked: no extra decoding
    with pytest.raises(ValueError, match="compare=1; allowed values: True or False"):
        speculative_generate(model, ids, mask, compare=1)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(gamma=0), r"gamma=0; allowed values: an int >= 1"),
    (dict(draft="medusa"), r"draft='medusa' is unknown; allowed values: \['double_sparsity', 'hip', 'lserve', 'quant4', "
                           r"'quest', 'recycled_attention', 'retrieval', 'shadowkv', 'sink_window', 'tidal_decode', "
                           r"'token_select', 'topk'\]"),
    (dict(draft="quant4", gamma=200), r"gamma=200 exceeds the full-precision residual"),
    (dict(draft_budget=500), r"draft_budget=500 is larger than the context \(40 tokens\)"),
    (dict(do_sample=True, temperature=0.0), r"temperature=0.0; allowed values"),
])
def test_bad_speculative_arguments(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        speculative_generate(model, torch.randint(3, 128, (1, 40)), **kwargs)
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_smollm2_greedy_speculation_is_lossless_for_every_draft(smollm2):
    model, tok = smollm2
    text = "Summarise the following notes. " + " ".join(f"Note {i}: the shipment of item {i * 7} arrived late." for i in range(40))
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = plain(model, ids, torch.ones_like(ids), 16)
    # every draft at one gamma, taking turns between one token drafted and several (rollback inside a round); the
    # tiny models run every draft at gammas 1, 3 and 5
    for draft, gamma in zip(KINDS, [1, 4] * len(KINDS)):
        out = speculative_generate(model, ids, draft=draft, gamma=gamma, max_new_tokens=16, draft_budget=64,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert out.tolist() == ref.tolist(), (draft, gamma)
    with kvpress.patch_model(model, "kivi", bits=8, group_size=32, residual_length=32):
        ref = plain(model, ids, torch.ones_like(ids), 16)
        for gamma in (1, 3, 5):
            out = speculative_generate(model, ids, draft="quant4", gamma=gamma, max_new_tokens=16)
            assert out.tolist() == ref.tolist(), ("quant4", gamma)


PROCESSED = {"repetition_penalty": dict(repetition_penalty=1.8), "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
             "bad_words_ids": "bad", "suppress_tokens": "suppress", "min_new_tokens": "eos",
             "top_k=1 sampling": dict(do_sample=True, top_k=1)}


@pytest.mark.parametrize("setting", list(PROCESSED))
def test_custom_generate_applies_generate_s_logits_processors(setting):
    """custom_generate ignored the processors generate prepared: with repetition_penalty, no_repeat_ngram_size,
    bad_words_ids, suppress_tokens, min_new_tokens or do_sample with top_k=1 it gave other tokens than plain generate
    with the same settings. They now apply at every drafted and verified position: the same tokens."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, 40:]
    kwargs = PROCESSED[setting]
    if kwargs == "bad":
        kwargs = dict(bad_words_ids=[[int(t)] for t in plain[:3]])  # the tokens plain greedy picks first
    elif kwargs == "suppress":
        kwargs = dict(suppress_tokens=[int(t) for t in plain[:3]])
    elif kwargs == "eos":  # plain greedy's 3rd token as EOS: min_new_tokens holds it back until 12 tokens
        kwargs = dict(eos_token_id=int(plain[2]), min_new_tokens=12)
    kwargs = dict(dict(do_sample=False, max_new_tokens=24), **kwargs)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert not torch.equal(expected[0, 40:40 + len(plain)], plain) or setting == "top_k=1 sampling"
    got = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=custom_generate,
                         draft="sink_window", gamma=3, draft_budget=16, **kwargs)
    assert torch.equal(got, expected)


def test_custom_generate_refuses_stopping_criteria_it_does_not_apply():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"stopping criteria \['MaxTimeCriteria'\]"):
        model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=custom_generate, max_time=30.0,
                       max_new_tokens=4)
