"""Issue 6: ragged per-head storage, budget allocators (uniform / pyramid / adaptive), chunked prefill, decode budget."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.kernels import triton_sparse
from kvpress.kernels.online_softmax import Queries
from kvpress.policies.allocation import adaptive_head_budgets, pyramid_budgets

from conftest import greedy, record_held_tokens, tiny_model


# ---------------------------------------------------------------------------- ragged storage
def _ragged_layer(batch, heads, length, dim, n_new, seed, dtype=torch.float32):
    """A layer whose heads keep random, different subsets of `length` prompt tokens, then `n_new` appended.
    Returns (layer, the full K/V, kept mask over every token seen)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length + n_new, dim, generator=g).to(dtype)
    values = torch.randn(batch, heads, length + n_new, dim, generator=g).to(dtype)
    layer = KVPressLayer()
    layer.update(keys[:, :, :length], values[:, :, :length])
    n_keep = torch.randint(1, length + 1, (batch, heads), generator=g)
    n_keep[0, 0], n_keep[0, -1] = length, 1  # one head keeps everything, another one token
    scores = torch.rand(batch, heads, length, generator=g)
    kept = torch.zeros(batch, heads, length + n_new, dtype=torch.bool)
    order = scores.argsort(-1, descending=True)
    width = int(n_keep.max())
    indices = order[..., :width]
    keep_valid = torch.arange(width) < n_keep[..., None]
    kept[..., :length].scatter_(-1, indices, keep_valid)
    layer.keep(indices, keep_valid)
    if n_new:
        layer.update(keys[:, :, length:], values[:, :, length:])
    kept[..., length:] = True
    return layer, keys, values, kept


def _dense_masked_attention(query, keys, values, kept, query_positions, scaling):
    """Independent reference: plain softmax attention over every token, removed ones and the future masked."""
    batch, hq, rows, dim = query.shape
    hkv = keys.shape[1]
    k = keys.repeat_interleave(hq // hkv, 1).double()
    v = values.repeat_interleave(hq // hkv, 1).double()
    logits = query.double() @ k.transpose(-1, -2) * scaling
    positions = torch.arange(keys.shape[2])
    allowed = kept.repeat_interleave(hq // hkv, 1)[:, :, None, :] & (positions[None, :] <= query_positions[:, None])
    logits = logits.masked_fill(~allowed, -math.inf)
    return (logits.softmax(-1) @ v).to(query.dtype)


@pytest.mark.parametrize("seed", range(6))
def test_ragged_attention_equals_dense_attention_with_removed_tokens_masked(seed):
    g = torch.Generator().manual_seed(100 + seed)
    batch, hkv, group = int(torch.randint(1, 3, (1,), generator=g)), int(torch.randint(2, 4, (1,), generator=g)), 2
    length, n_new, rows, dim = int(torch.randint(5, 60, (1,), generator=g)), int(torch.randint(0, 5, (1,), generator=g)), 1, 16
    layer, keys, values, kept = _ragged_layer(batch, hkv, length, dim, n_new, seed)
    assert layer.is_flat and layer.tail.num_slots == n_new
    seen = length + n_new
    for rows in (1, min(3, seen)):
        qpos = torch.arange(seen - rows, seen)
        query = torch.randn(batch, hkv * group, rows, dim, generator=g)
        expected = _dense_masked_attention(query, keys, values, kept, qpos, dim ** -0.5)
        got = layer.attention(Queries(query, qpos, dim ** -0.5), use_triton=False)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        if triton_sparse.available():
            got = layer.attention(Queries(query, qpos, dim ** -0.5), use_triton=True)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_ragged_storage_holds_exactly_the_kept_tokens():
    layer, keys, _, kept = _ragged_layer(2, 3, 40, 16, 2, seed=1, dtype=torch.float16)
    assert torch.equal(layer.tokens_per_head(), kept.sum(-1))
    # every stored tensor owns exactly its bytes (no views of freed buffers), and nbytes() counts them all
    tensors = [t for segment in layer.segments for t in segment.tensors()]
    assert layer.nbytes() == sum(t.untyped_storage().nbytes() for t in tensors)
    kept_tokens = int(kept.sum())
    assert layer.kv_nbytes() == kept_tokens * 2 * 16 * 2  # K and V, fp16, no padding anywhere
    # the dense layout would need the widest head in every head
    assert layer.kv_nbytes() < int(kept.sum(-1).max()) * 2 * 3 * 2 * 16 * 2
    # the padded view reproduces each head's kept keys in position order
    view, valid = layer.keys_view(), layer.key_valid()
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(view[b, h][valid[b, h]], keys[b, h][kept[b, h]])


def test_flat_segment_round_trips_through_padding_and_batch_ops():
    layer, *_ = _ragged_layer(3, 2, 30, 8, 0, seed=2)
    seg = layer.segments[0]
    assert seg.flat
    again = seg.to_rect().to_flat(0)
    assert torch.equal(again.data.keys, seg.data.keys) and torch.equal(again.lengths, seg.lengths)
    assert torch.equal(again.positions, seg.positions)
    before = layer.tokens_per_head().clone()
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.tokens_per_head(), before[[2, 0]])


def test_ragged_layer_evicts_again_and_crops_its_residual():
    layer, keys, values, kept = _ragged_layer(1, 2, 30, 8, 3, seed=3)
    n = layer.tokens_per_head().clone()
    layer.crop(-2)
    assert torch.equal(layer.tokens_per_head(), n - 2)
    valid = layer.key_valid()
    scores = torch.rand(valid.shape)
    from kvpress.policies.base import select_kept
    n_keep = torch.minimum(torch.tensor([[9, 5]]), valid.sum(-1))
    layer.keep(*select_kept(scores, valid, n_keep))
    assert torch.equal(layer.tokens_per_head(), n_keep)
    assert layer.kv_nbytes() == int(n_keep.sum()) * 2 * 8 * 4


# ---------------------------------------------------------------------------- allocators
def test_pyramid_budgets_sum_to_the_uniform_total_and_decrease():
    for mean, length, layers, window in [(100, 1000, 30, 32), (50, 60, 4, 8), (7, 1000, 5, 0), (40, 41, 3, 32)]:
        budgets = pyramid_budgets(torch.tensor([mean, mean // 2 + 1]), torch.tensor([length, length]), layers,
                                  window, 20.0)
        assert budgets.sum(0).tolist() == [layers * mean, layers * (mean // 2 + 1)]
        assert bool((budgets[:-1] >= budgets[1:]).all())
        assert bool((budgets <= length).all())


def test_adaptive_budgets_keep_the_layer_total_respect_the_floor_and_pick_the_best_across_heads():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        batch, heads, width = 2, 4, 50
        scores = torch.rand(batch, heads, width, generator=g) ** torch.tensor([1.0, 4.0, 8.0, 0.5])[:, None]
        valid = torch.rand(batch, heads, width, generator=g) > 0.1
        valid[..., -5:] = True
        n_valid = valid.sum(-1)
        n_keep = torch.minimum(torch.full_like(n_valid, 12), n_valid)
        protected = torch.zeros_like(valid)
        protected[..., -3:] = True  # a window
        floor = [0.0, 0.2, 0.5, 1.0][trial % 4]
        counts, priority = adaptive_head_budgets(scores, valid, n_keep, protected, floor)
        assert torch.equal(counts.sum(-1), n_keep.sum(-1))
        assert bool((counts >= torch.floor(n_keep * floor)).all())
        from kvpress.policies.base import select_kept
        indices, ok = select_kept(priority, valid, counts)
        kept = torch.zeros_like(valid).scatter_(-1, indices, ok)
        assert bool((kept & protected == protected).all())
        # outside each head's protected + floor slots, every kept score >= every removed score of the layer
        rank = scores.masked_fill(~valid, -1).masked_fill(protected, 2).argsort(-1, descending=True).argsort(-1)
        free = ~protected & (rank >= torch.floor(n_keep * floor)[..., None])
        for b in range(batch):
            chosen = scores[b][kept[b] & free[b]]
            removed = scores[b][~kept[b] & valid[b] & free[b]]
            if chosen.numel() and removed.numel():
                assert float(chosen.min()) >= float(removed.max())


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "tova", "knorm"])
def test_allocators_on_a_model_keep_the_same_bytes_and_the_right_totals(policy):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(0))
    budget, layers, heads = 24, 2, 2  # 120 * (1 - 0.8)
    kept, kv = {}, {}
    for allocation in ("uniform", "pyramid", "adaptive"):
        extra = dict(window_size=8) if policy == "snapkv" else {}
        with kvpress.patch_model(model, policy, compression_ratio=0.8, budget_allocation=allocation, **extra):
            cache = KVPressCache(model.config)
            model(ids, cache=cache)
        kept[allocation] = torch.stack([layer.tokens_per_head()[0] for layer in cache.layers])  # [layers, heads]
        kv[allocation] = sum(layer.kv_nbytes() for layer in cache.layers)
        bytes_per_token = 2 * 16 * 4
        assert kv[allocation] == int(kept[allocation].sum()) * bytes_per_token  # no padding, for every allocator
    assert bool((kept["uniform"] == budget).all())
    assert kept["adaptive"].sum(-1).tolist() == [heads * budget] * layers  # per layer
    assert kept["pyramid"].sum().item() == layers * heads * budget  # over layers
    assert kept["pyramid"][0, 0] > kept["pyramid"][1, 0]
    assert kv["adaptive"] == kv["uniform"] == kv["pyramid"]


def test_pyramid_spreads_the_budget_over_full_attention_layers_only():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from conftest import _COMMON

    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    model = Gemma3ForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.8, budget_allocation="pyramid", window_size=4):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    kept = [int(layer.tokens_per_head().max()) for _, layer in cache.kvpress_layers()]
    assert sum(kept) == 2 * 20 and kept[0] > kept[1]


def test_adaptive_decode_matches_dense_attention_over_the_kept_tokens():
    """Greedy decode over a ragged (adaptive) cache equals the stock model reading, per head, only its kept K/V
    (an independent path: eager attention with the removed tokens masked)."""
    model = tiny_model("llama", attn="eager")
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.7, budget_allocation="adaptive", window_size=4):
        cache = KVPressCache(model.config)
        out = model(ids, cache=cache)
        assert any(layer.is_flat for layer in cache.layers)
        nxt = out.logits[:, -1:].argmax(-1)
        logits = model(nxt, cache=cache).logits[:, -1]
    # reference: prompt + next token through the stock model; the prompt's own queries see every earlier token
    # (prefill is exact), the new token's query sees only what each head kept
    masks = []
    for layer in cache.layers:
        m = torch.zeros(1, 2, 81, dtype=torch.bool)
        m.scatter_(-1, layer.key_positions().long(), layer.key_valid())
        masks.append(m)

    def masked_eager(module, query, key, value, attention_mask, scaling, **kw):
        allowed = torch.ones(81, 81, dtype=torch.bool).tril().expand(1, 4, 81, 81).clone()
        allowed[:, :, -1] = masks[module.layer_idx].repeat_interleave(2, 1)
        k = key.repeat_interleave(2, 1)
        v = value.repeat_interleave(2, 1)
        w = (query @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -math.inf).softmax(-1)
        return (w @ v).transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface
    AttentionInterface.register("test_masked_eager", masked_eager)
    model.set_attn_implementation("test_masked_eager")
    try:
        ref = model(torch.cat([ids, nxt], 1)).logits[:, -1]
    finally:
        model.set_attn_implementation("eager")
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_chunked_prefill_with_none_equals_one_shot(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 150), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # a left-padded row
    ref = greedy(model, ids, 12, attention_mask=mask)
    with kvpress.patch_model(model, "none", prefill_chunk_size=40):
        out = greedy(model, ids, 12, attention_mask=mask)
    assert torch.equal(out, ref)
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__  # unpatch restored both


def test_chunked_prefill_never_holds_more_than_budget_plus_one_chunk():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    chunk, budget = 50, 30  # 300 * (1 - 0.9)
    with record_held_tokens() as peak, kvpress.patch_model(model, "snapkv", compression_ratio=0.9, window_size=8,
                                                             prefill_chunk_size=chunk):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    assert len(peak) == 2 * 6  # 2 layers x 6 chunks
    assert max(peak) <= budget + chunk
    assert all(int(layer.tokens_per_head().max()) == budget for layer in cache.layers)
    # logits of the whole prompt are returned when the caller asks for them (logits_to_keep=0)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.9, window_size=8, prefill_chunk_size=chunk):
        out = model(ids, cache=KVPressCache(model.config), logits_to_keep=0)
        assert out.logits.shape[1] == 300


@pytest.mark.parametrize("arch,question", [("llama", 0), ("qwen2", 0), ("llama", 12)])
def test_chunked_eviction_computes_each_chunk_over_exactly_what_earlier_chunks_kept(arch, question, monkeypatch):
    """Independent reference for chunked prefill with eviction. A scorer that depends on the position alone keeps
    the same positions in every layer and head, so the model's own attention with a 4D mask (each chunk sees the
    earlier chunks' kept tokens and itself, causally; generated tokens see what the prompt kept) must give the
    same logits for every prompt position and for the generated tokens. With a question appended to each chunk
    (it votes, is never kept) nothing changes: it comes after the chunk, and this scorer ignores its votes."""
    from kvpress.policies.snapkv import SnapKV

    model = tiny_model(arch)
    length, chunk, n_new = 150, 40, 3
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(11))
    rank = torch.rand(length + n_new, generator=torch.Generator().manual_seed(12))
    monkeypatch.setattr(SnapKV, "score", lambda self, ctx: rank[ctx.layer.key_positions()])
    extra = {"question_tokens": question} if question else {}
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.7, window_size=8, prefill_chunk_size=chunk,
                             **extra), torch.no_grad():
        cache = KVPressCache(model.config)
        logits = [model(ids, cache=cache, logits_to_keep=0).logits[0]]
        kept = [torch.zeros(length, dtype=torch.bool).index_fill_(0, layer.key_positions()[0, h][valid].long(), True)
                for layer in cache.layers for h, valid in enumerate(layer.key_valid()[0])]
        assert all(torch.equal(k, kept[0]) for k in kept) and int(kept[0].sum()) == length - int(length * 0.7)
        tokens = ids
        for _ in range(n_new):
            step = logits[-1][-1:].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step], 1)
            logits.append(model(step, cache=cache).logits[0])
    total = tokens.shape[1]
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    seen_kept = torch.ones(total, dtype=torch.bool)
    seen_kept[:length] = kept[0]
    for start in range(length - (length - 1) // chunk * chunk, length, chunk):  # chunks end at the prompt's end
        allowed[start:, :start] &= seen_kept[:start]  # what each chunk kept is all that later tokens see
    allowed[length:, :length] &= kept[0]
    mask = torch.zeros(1, 1, total, total).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        ref = model(tokens, attention_mask=mask).logits[0]
    torch.testing.assert_close(torch.cat(logits), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- decode budget
@pytest.mark.parametrize("slack", [0, 7])
def test_decode_budget_holds_over_1000_generated_tokens(slack):
    """Generated tokens never exceed decode_budget (+ slack: cut back in one step once over it)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    prefill_budget, decode_budget = 25, 40
    with kvpress.patch_model(model, "h2o", compression_ratio=0.75, decode_budget=decode_budget, slack=slack):
        cache = KVPressCache(model.config)
        logits = model(ids, cache=cache).logits[:, -1]
        worst = 0
        for _ in range(1000):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
            worst = max(worst, max(int(layer.tokens_per_head().max()) for layer in cache.layers))
    assert worst == prefill_budget + decode_budget + slack
    for layer in cache.layers:
        positions = layer.key_positions()[layer.key_valid()]
        assert int((positions < 100).sum()) == 2 * prefill_budget  # the prompt part never shrinks
        assert int((positions >= 1000).sum()) > 0  # recent tokens stay
    assert cache.layers[0].seen == 1100


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="snapkv", compression_ratio=0.5, budget_allocation="nope"), "budget_allocation='nope'.*allowed"),
    (dict(policy="snapkv", compression_ratio=0.5, budget_allocation="adaptive", head_floor=1.5), "head_floor=1.5.*mean"),
    (dict(policy="snapkv", compression_ratio=0.5, pyramid_beta=0.5), "pyramid_beta"),
    (dict(policy="snapkv", compression_ratio=0.5, prefill_chunk_size=0), "prefill_chunk_size=0.*>= 1"),
    (dict(policy="snapkv", compression_ratio=0.5, prefill_chunk_size=16), "prefill_chunk_size=16.*window_size=32"),
    (dict(policy="h2o", compression_ratio=0.5, decode_budget=0), "decode_budget=0"),
    (dict(policy="h2o", compression_ratio=0.5, slack=-1), "slack=-1.*an int >= 0"),
    (dict(policy="snapkv", compression_ratio=0.5, slack=8), "slack=8 has nothing to act on.*decode_budget"),
])
def test_bad_budget_options_raise_before_the_model_is_touched(kwargs, match):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, **kwargs)
    assert model.config._attn_implementation == before and "generate" not in model.__dict__


def _held(cache):
    """Per kvpress layer: what it holds for a next token to read (positions, validity, K/V dequantized)."""
    return {i: (layer.key_positions().long(), layer.key_valid(), layer.keys_view().float(), layer.values_view().float())
            for i, layer in cache.kvpress_layers()}


def _reference_last_token_logits(model, ids, nxt, held):
    """Independent path for one new token over a compressed cache: the stock model on [ids, nxt], where every
    prompt row attends as in a full-cache prefill (prefill is exact), and the new token's row reads, per head,
    only the kept slots `held`, with the K/V the cache holds (dequantized where low-bit)."""
    n = ids.shape[1] + 1

    def reference(module, query, key, value, attention_mask, scaling, **kw):
        g = query.shape[1] // key.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        w = (query @ k.transpose(-1, -2) * scaling).masked_fill(~causal, -math.inf).softmax(-1)
        out = w @ v
        pos, ok, hk, hv = held[module.layer_idx]
        last_k, last_v = key[:, :, -1:].float(), value[:, :, -1:].float()  # the new token itself
        ks = torch.cat([hk, last_k], 2).repeat_interleave(g, 1)
        vs = torch.cat([hv, last_v], 2).repeat_interleave(g, 1)
        allowed = torch.cat([ok, torch.ones_like(ok[..., :1])], -1).repeat_interleave(g, 1)
        logits = (query[:, :, -1:].float() @ ks.transpose(-1, -2) * scaling).masked_fill(~allowed[:, :, None], -math.inf)
        out[:, :, -1:] = (logits.softmax(-1) @ vs).to(out.dtype)
        return out.transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface
    AttentionInterface.register("test_reference", reference)
    model.set_attn_implementation("test_reference")
    try:
        return model(torch.cat([ids, nxt], 1)).logits[:, -1]
    finally:
        model.set_attn_implementation("sdpa")


def test_per_head_budgets_compose_with_a_codec_in_flat_low_bit_storage():
    """snapkv adaptive + KIVI: heads keep different counts, each head's oldest whole groups become low-bit codes in
    flat per-head runs (no padding), >= residual newest tokens stay full precision; the next token reads exactly
    the kept, dequantized K/V."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(9))
    nxt = torch.tensor([[7]])
    kivi = dict(bits=4, group_size=16, residual_length=16)
    with kvpress.patch_model(model, "snapkv+kivi", compression_ratio=0.5, budget_allocation="adaptive",
                             window_size=8, **kivi):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
        differ = False
        for layer in cache.layers:
            low, fp = layer.segments[0], layer.segments[1]
            assert low.low_bit and low.flat and fp.flat and not fp.low_bit and layer.tail.num_slots == 0
            kept = layer.tokens_per_head()
            assert kept.sum() == 2 * 80  # AdaKV keeps the uniform total, spread over heads
            assert bool((low.lengths % 16 == 0).all()) and bool((fp.lengths >= 16).all())
            assert bool((fp.lengths < 16 + 16).all()) and torch.equal(low.lengths + fp.lengths, kept)
            differ |= bool((kept != kept[:, :1]).any())
            # bytes: no filler slot anywhere (codes, scales and full-precision rows of the kept tokens only)
            codes = low.data
            assert codes.k_codes.shape[2] == int(low.lengths.sum()) and fp.data.keys.shape[2] == int(fp.lengths.sum())
        assert differ, "heads should keep different counts here"
        held = _held(cache)
        got = model(nxt, cache=cache).logits[:, -1]
    torch.testing.assert_close(got, _reference_last_token_logits(model, ids, nxt, held), atol=1e-4, rtol=1e-4)


def test_self_speculation_over_an_adaptive_cache_is_lossless():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(5))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.6, budget_allocation="adaptive", window_size=8):
        ref = greedy(model, ids, 16)
        out = kvpress.speculative_generate(model, ids, draft="sink_window", gamma=3, max_new_tokens=16,
                                           draft_budget=24)
    assert torch.equal(out[:, :ref.shape[1]], ref)


def test_masked_attention_in_query_blocks_equals_one_block(monkeypatch):
    """A long chunk over a compacted layer runs its dense-mask attention in row blocks; same logits as one block."""
    from kvpress.cache import read as read_module

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 700), generator=torch.Generator().manual_seed(7))
    outs = []
    for rows in (read_module.MASK_ROWS, 10**9):
        monkeypatch.setattr(read_module, "MASK_ROWS", rows)
        with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=8, prefill_chunk_size=300):
            outs.append(model(ids, cache=KVPressCache(model.config), logits_to_keep=0).logits)
    assert outs[0].shape[1] == 700
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_ragged_layer_pads_back_to_a_consistent_rectangle():
    layer, keys, values, kept = _ragged_layer(2, 3, 30, 8, 2, seed=8)
    view = (layer.keys_view(), layer.values_view(), layer.key_positions(), layer.key_valid())
    layer.to_rectangular()
    assert not layer.is_flat and len(layer.segments) == 1
    rect = layer.segments[0]
    assert rect.data.keys.shape[2] == rect.positions.shape[-1] == rect.valid.shape[-1] == view[0].shape[2]
    for before, after in zip(view, (rect.data.keys, rect.data.values, layer.key_positions(), layer.key_valid())):
        assert torch.equal(before.to(after.dtype), after)
    assert torch.equal(layer.tokens_per_head(), kept.sum(-1))
