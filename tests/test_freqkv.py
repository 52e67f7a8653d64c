"""FreqKV (docs/policies.md 12.12): the merge is the paper's definition, written here on its own (RoPE from its formula,
the DCT as explicit cosine sums, the iterative rounds over the oldest `capacity` slots); a decode step reads exactly
the definition's keys and values at cache-local positions; the cache never holds more than its capacity, and its
bytes are the slots it holds; bad settings are refused before anything changes."""

import math

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.policies.freqkv import resampler

from conftest import greedy, record_held_tokens, tiny_model
from test_shadowkv import _rope

D = 16  # the tiny Llama's head_dim


def _dct_resample(x, m):
    """x [n, C] -> [m, C]: orthonormal DCT-II coefficients along n as cosine sums, the first m kept, an orthonormal
    inverse DCT of length m, times sqrt(m / n)."""
    n = x.shape[0]
    j = torch.arange(n, dtype=torch.float64)
    coef = torch.stack([(math.sqrt((1 if k == 0 else 2) / n) * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))[:, None]
                         * x.double()).sum(0) for k in range(m)])
    i = torch.arange(m, dtype=torch.float64)
    out = sum(math.sqrt((1 if k == 0 else 2) / m) * torch.cos(math.pi * (2 * i + 1) * k / (2 * m))[:, None] * coef[k]
              for k in range(m))
    return out * math.sqrt(m / n)


def test_resampler_is_the_identity_at_full_length_and_resamples_band_limited_sequences():
    for n in (1, 7, 32):
        assert torch.allclose(resampler(n, n), torch.eye(n, dtype=torch.float64), atol=1e-12)
    # f(t) = sum_k c_k cos(pi k t) with k < m, sampled at t = (j + 1/2) / n, comes out sampled at (i + 1/2) / m
    n, m = 40, 13
    c = torch.randn(m, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(t):
        return (c[:, None] * torch.cos(math.pi * torch.arange(m, dtype=torch.float64)[:, None] * t)).sum(0)

    samples = f((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    assert torch.allclose(resampler(n, m) @ samples, f((torch.arange(m, dtype=torch.float64) + 0.5) / m), atol=1e-10)
    x = torch.randn(n, 3, dtype=torch.float64)
    assert torch.allclose(resampler(n, m) @ x, _dct_resample(x, m), atol=1e-10)


def _definition(keys, values, capacity, n_sink, recent, ratio):
    """The paper's rounds on one row: keys / values [Hkv, n, D] post-RoPE at positions 0..n-1 -> (post-RoPE keys at the
    recorded positions, values, positions) while more than `capacity` slots remain."""
    n = keys.shape[1]
    positions = torch.arange(n)
    pre = torch.stack([_rope(k.double(), -positions) for k in keys])  # rotating by -p un-rotates
    post, vals = keys.double(), values.double()
    sinks, rec = min(n_sink, capacity - 1), None
    rec = min(recent, capacity - 1 - sinks)
    span = capacity - sinks - rec
    size = math.floor(ratio * span)
    while positions.numel() > capacity:
        end = sinks + span
        new_pre = torch.stack([_dct_resample(pre[h, sinks:end], size) for h in range(pre.shape[0])])
        new_vals = torch.stack([_dct_resample(vals[h, sinks:end], size) for h in range(pre.shape[0])])
        new_pos = positions[sinks:end][[int((i + 0.5) * span / size) for i in range(size)]]
        new_post = torch.stack([_rope(p, new_pos) for p in new_pre])
        pre = torch.cat([pre[:, :sinks], new_pre, pre[:, end:]], 1)
        post = torch.cat([post[:, :sinks], new_post, post[:, end:]], 1)
        vals = torch.cat([vals[:, :sinks], new_vals, vals[:, end:]], 1)
        positions = torch.cat([positions[:sinks], new_pos, positions[end:]])
    return post, vals, positions


@pytest.mark.parametrize("n_sink, recent, ratio", [(4, 0, 0.5), (2, 3, 0.3)])
def test_the_prompt_is_merged_as_the_definition_says(n_sink, recent, ratio):
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 61), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(ids, cache=reference, use_cache=True)
        with kvpress.patch_model(model, policy="freqkv", budget=24, n_sink=n_sink, recent=recent, ratio=ratio):
            cache = kvpress.KVPressCache(model.config)
            model(ids, cache=cache, use_cache=True)
    for ref, (_, layer) in zip(reference.layers, cache.kvpress_layers()):
        keys, values, positions = _definition(ref.keys[0], ref.values[0], 24, n_sink, recent, ratio)
        assert layer.key_valid().all() and layer.view_width == positions.numel() <= 24
        assert torch.equal(layer.key_positions()[0, 0].long(), positions)
        assert torch.allclose(layer.keys_view()[0].double(), keys, atol=1e-5)
        assert torch.allclose(layer.values_view()[0].double(), values, atol=1e-5)


@pytest.mark.parametrize("cache_local", [True, False])
def test_a_decode_step_reads_the_definitions_keys_at_cache_local_positions(cache_local):
    """HF's own attention over the definition's merged keys and values, put in a DynamicCache rotated at contiguous
    positions ending right behind the query (the paper's cache-local RoPE), or at the recorded positions."""
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 50), generator=torch.Generator().manual_seed(2))
    nxt = torch.tensor([[7]])
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(ids, cache=reference, use_cache=True)
        merged = DynamicCache(config=model.config)
        for layer_idx, ref in enumerate(reference.layers):
            keys, values, positions = _definition(ref.keys[0], ref.values[0], 20, 4, 0, 0.5)
            n = positions.numel()
            target = torch.arange(50 - n, 50) if cache_local else positions  # the query sits at 50
            keys = torch.stack([_rope(k, target - positions) for k in keys])  # re-rotate by the offset
            merged.update(keys[None].float(), values[None].float(), layer_idx)
        expected = model(nxt, cache=merged, use_cache=True, position_ids=torch.tensor([[50]]),
                         attention_mask=torch.ones(1, n + 1, dtype=torch.long)).logits
        with kvpress.patch_model(model, policy="freqkv", budget=20, cache_local_positions=cache_local):
            cache = kvpress.KVPressCache(model.config)
            model(ids, cache=cache, use_cache=True)
            got = model(nxt, cache=cache, use_cache=True).logits
    assert torch.allclose(got, expected, atol=1e-4)


def test_never_more_than_the_capacity_and_bytes_are_the_slots_held():
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), kvpress.patch_model(model, policy="freqkv", budget=24, n_sink=2, recent=4) as patch:
        cache = kvpress.KVPressCache(model.config)
        with record_held_tokens() as held:
            greedy(model, ids, 30, cache=cache)
    # after the prompt and every decode step the cache holds at most 24 (an append may hold 25 until its merge)
    assert max(held[2:]) <= 25 and cache.layers[0].tokens_per_head().max() <= 24
    for _, layer in cache.kvpress_layers():
        positions = layer.key_positions()[0, 0]
        assert bool((positions[1:] > positions[:-1]).all())  # merged slots keep position order
        # keys + values (fp32) of 2 KV heads: the 24 slots and room for the one append that starts the next round
        assert layer.kv_nbytes() == 2 * 2 * 25 * D * 4
    assert patch.policy.appends_before_change(cache.layers[0]) == 24 - int(cache.layers[0].tokens_per_head().max())


def test_generated_tokens_are_merged_again_when_the_cache_fills():
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), kvpress.patch_model(model, policy="freqkv", budget=24):
        cache = kvpress.KVPressCache(model.config)
        greedy(model, ids, 20, cache=cache)
    layer = cache.layers[0]
    # the prompt's 30 merged to 4 + 10 + 6 = 20; full again after 4 more, then a round every 10 tokens
    assert layer.tokens_per_head().max() <= 24 and layer.seen == 49
    assert int(layer.key_positions()[0, 0, -1]) == 48  # the newest token is exact and at its own position


def test_bad_settings_are_refused_before_anything_changes():
    model = tiny_model("llama")
    for params, word in ((dict(compression_ratio=0.5, ratio=1.0), "ratio"),
                         (dict(compression_ratio=0.5, ratio=-0.1), "ratio"),
                         (dict(budget=8, n_sink=4, recent=4), "budget"),
                         (dict(compression_ratio=0.5, n_sink=-1), "n_sink"),
                         (dict(compression_ratio=0.5, recent=-2), "recent")):
        with pytest.raises(ValueError, match=word):
            kvpress.patch_model(model, policy="freqkv", **params)
    with pytest.raises(ValueError, match="freqkv alone"):
        kvpress.patch_model(model, policy="freqkv+kivi", compression_ratio=0.5, bits=4)
