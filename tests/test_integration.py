"""patch_model on tiny random models of every supported architecture."""

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.kernels.online_softmax import Queries
from kvpress.integrations.hf import given_cache
from kvpress.policies import H2O, TOVA, SnapKV, StreamingLLM

from conftest import TINY, greedy, tiny_model

ARCHS = sorted(TINY)


def model_state(model):
    """Everything patch_model may touch: attention implementation, instance attributes, hooks."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation, sorted(model.__dict__), hooks


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_none_policy_is_token_identical_and_unpatch_restores(arch, attn):
    model = tiny_model(arch, attn)
    ids = torch.randint(3, 128, (1, 24))
    before_state = model_state(model)
    ref_tokens = greedy(model, ids, 24)
    ref_logits = model(ids).logits
    with kvpress.patch_model(model, "none"):
        assert model.config._attn_implementation == f"kvpress_{attn}"
        assert torch.equal(greedy(model, ids, 24), ref_tokens)
    assert model_state(model) == before_state
    assert torch.equal(model(ids).logits, ref_logits)  # bit-identical after unpatch
    assert torch.equal(greedy(model, ids, 24), ref_tokens)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "tova", "knorm", "streaming_llm", "random"])
def test_each_architecture_compresses_full_attention_layers(arch, policy):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 40))
    with kvpress.patch_model(model, policy, compression_ratio=0.5):
        greedy(model, ids, 6)
    stats = kvpress.last_cache_stats(model)
    kv_layers = [row for row in stats["layers"] if row["kind"] == "kvpress"]
    assert kv_layers and stats["seen"] == 45
    decode_evicts = policy in ("h2o", "tova", "streaming_llm")
    expected = 20 if decode_evicts else 20 + 5  # 40 * (1 - 0.5) after prefill, then + 5 fed tokens
    assert all(row["kept_min"] == row["kept_max"] == expected for row in kv_layers)
    assert stats["prefill_kv_bytes"] < sum(r["kv_bytes"] for r in stats["layers"]) * 45 / 20  # prefill freed


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_decode_over_compressed_cache_equals_dense_attention_on_kept_tokens(arch, attn, monkeypatch):
    """Independent computation: the stock model with a plain DynamicCache holding exactly the kept K/V and the
    new token at its original absolute position must give the same logits, step after step. The decode steps
    read the compacted layers with no mask at all (every slot is readable), which is what this checks."""
    unmasked, real = [], Queries.reads_every_slot

    def recorded(self, key_valid):
        unmasked.append(real(self, key_valid))
        return unmasked[-1]

    monkeypatch.setattr(Queries, "reads_every_slot", recorded)
    model = tiny_model(arch, attn)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (1, 50))
    steps = torch.randint(3, 128, (1, 4))
    with kvpress.patch_model(model, SnapKV(budget=20, window_size=4)):
        cache = KVPressCache(model.config)
        model(ids, cache=cache, attention_mask=torch.ones_like(ids))
        kept = [(layer.keys_view().clone(), layer.values_view().clone()) for layer in cache.layers]
        assert all(layer.view_width == 20 and layer.explicit_positions for layer in cache.layers)
        # per-head kept sets really differ (otherwise this test would not exercise per-head storage)
        assert any(not torch.equal(l.key_positions()[0, 0], l.key_positions()[0, 1]) for l in cache.layers)
        logits = []
        for i in range(steps.shape[1]):
            mask = torch.ones(1, 51 + i, dtype=torch.long)
            logits.append(model(steps[:, i:i + 1], cache=cache, attention_mask=mask).logits)
    dense = DynamicCache()
    for i, (k, v) in enumerate(kept):
        dense.update(k, v, i)
    for i in range(steps.shape[1]):
        ref = model(steps[:, i:i + 1], cache=dense, position_ids=torch.tensor([[50 + i]]),
                    attention_mask=torch.ones(1, 21 + i, dtype=torch.long)).logits
        torch.testing.assert_close(logits[i], ref, atol=1e-5, rtol=1e-5)
    assert sum(unmasked) == steps.shape[1] * len(cache.layers)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv"])
def test_unmasked_decode_reads_equal_masked_ones(policy, monkeypatch):
    """A decode step over a rectangular layer with no invalid slot reads it without a mask (sdpa, or the written-out
    softmax that gives H2O and TOVA their probabilities): the same tokens, kept positions and accumulated scores as
    the same steps with the mask built from stored positions."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(2))

    def run():
        cache = KVPressCache(model.config)
        with kvpress.patch_model(model, policy, budget=40):
            tokens = greedy(model, ids, 30, cache=cache)
        return tokens, [layer.key_positions() for layer in cache.layers], [layer.get_state("h2o_accumulated_attention")
                                                                          for layer in cache.layers]

    unmasked = run()
    monkeypatch.setattr(Queries, "reads_every_slot", lambda self, key_valid: False)
    masked = run()
    assert torch.equal(unmasked[0], masked[0])
    assert all(torch.equal(a, b) for a, b in zip(unmasked[1], masked[1]))
    for a, b in zip(unmasked[2], masked[2]):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))


def _instrument(model, record):
    def after(module, args, kwargs, output):
        cache = given_cache(kwargs)
        record.append([(layer.seen, layer.key_positions().clone(), layer.tokens_per_head().clone())
                       for layer in cache.layers if isinstance(layer, KVPressLayer)])
    return model.register_forward_hook(after, with_kwargs=True)


def test_h2o_holds_its_budget_for_200_tokens():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 64))
    record = []
    with kvpress.patch_model(model, H2O(budget=32, recent=8)):
        handle = _instrument(model, record)
        greedy(model, ids, 200)
        handle.remove()
    assert len(record) == 200
    for step in record:
        for seen, positions, kept in step:
            assert positions.shape[-1] == 32 and (kept == 32).all()
            newest = positions.sort(-1).values[..., -8:]  # slots evicted in place leave position order
            assert (newest == torch.arange(seen - 8, seen)).all()  # recent window always kept


def test_tova_holds_its_budget_while_decoding():
    model = tiny_model("qwen2")
    record = []
    with kvpress.patch_model(model, TOVA(budget=24)):
        handle = _instrument(model, record)
        greedy(model, torch.randint(3, 128, (1, 30)), 40)
        handle.remove()
    assert all(positions.shape[-1] == 24 for step in record for _, positions, _ in step)


def test_streaming_llm_holds_sinks_and_window():
    model = tiny_model("llama")
    record = []
    with kvpress.patch_model(model, StreamingLLM(n_sink=4, window=16)):
        handle = _instrument(model, record)
        greedy(model, torch.randint(3, 128, (1, 50)), 60)
        handle.remove()
    for step in record:
        for seen, positions, _ in step:
            expected = torch.cat([torch.arange(4), torch.arange(seen - 16, seen)])
            assert (positions.sort(-1).values == expected).all()


def test_explicit_cache_and_multi_turn_reuse_match_dynamic_cache():
    """A caller-supplied KVPressCache carried across two turns behaves like transformers' own cache (policy none),
    and a second turn on a compressed cache extends it without re-compressing (no prefill phase)."""
    model = tiny_model("llama")
    turn1, turn2 = torch.randint(3, 128, (1, 20)), torch.randint(3, 128, (1, 7))

    def two_turns(cache):
        out1 = greedy(model, turn1, 5, cache=cache)
        ids2 = torch.cat([out1, turn2], dim=1)
        return greedy(model, ids2, 5, cache=cache)

    ref = two_turns(DynamicCache(config=model.config))
    with kvpress.patch_model(model, "none"):
        assert torch.equal(two_turns(KVPressCache(model.config)), ref)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4):
        cache = KVPressCache(model.config)
        two_turns(cache)
        layer = cache.layers[0]
        # turn 1: 20 -> 10 kept, +4 decoded; turn 2 adds 1 + 7 prompt tokens and 4 decoded, nothing evicted
        assert layer.seen == 20 + 4 + 8 + 4 and layer.view_width == 10 + 4 + 8 + 4


def test_cache_local_positions_rotation_matches_rope_at_new_position():
    """Re-rotating a post-RoPE key by delta equals applying RoPE at position p + delta from scratch."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpress.positions import rotate_keys

    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    k = torch.randn(1, 2, 5, 16)
    pos = torch.tensor([[3, 10, 11, 40, 41]])
    delta = torch.tensor([-3, -9, 5, -30, 0]).view(1, 1, 5).expand(1, 2, 5)
    cos, sin = rotary(k, pos)
    _, k_at_pos = apply_rotary_pos_emb(k, k, cos, sin)
    cos2, sin2 = rotary(k, pos + delta[0, :1])
    _, k_at_new = apply_rotary_pos_emb(k, k, cos2, sin2)
    torch.testing.assert_close(rotate_keys(k_at_pos, delta, rotary.inv_freq), k_at_new, atol=1e-5, rtol=1e-5)


def test_cache_local_positions_match_contiguous_positions_reference():
    """Paper-faithful StreamingLLM: kept tokens sit at contiguous positions right behind the query. Reference:
    the stock model with a plain cache holding the kept keys rotated to positions seen-T .. seen-1."""
    from kvpress.positions import rotate_keys

    model = tiny_model("llama")
    ids, nxt = torch.randint(3, 128, (1, 60)), torch.tensor([[9]])
    with kvpress.patch_model(model, StreamingLLM(n_sink=4, window=12, cache_local_positions=True)):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
        stored = [(layer.keys_view().clone(), layer.values_view().clone(), layer.key_positions().clone())
                  for layer in cache.layers]
        logits = model(nxt, cache=cache).logits
    dense = DynamicCache()
    for i, (k, v, pos) in enumerate(stored):
        contiguous = torch.arange(60 - 16, 60).expand_as(pos)  # 16 kept slots right behind position 60
        dense.update(rotate_keys(k, contiguous - pos, model.model.rotary_emb.inv_freq), v, i)
    ref = model(nxt, cache=dense, position_ids=torch.tensor([[60]])).logits
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # and it differs from reading the keys at their original positions
    with kvpress.patch_model(model, StreamingLLM(n_sink=4, window=12)):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
        assert not torch.allclose(model(nxt, cache=cache).logits, ref, atol=1e-4)


def test_beam_search_reorders_the_compressed_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 30))
    kw = dict(max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False, attention_mask=torch.ones_like(ids))
    ref = model.generate(ids, **kw)
    with kvpress.patch_model(model, "none"):
        assert torch.equal(model.generate(ids, **kw), ref)
    with kvpress.patch_model(model, "h2o", budget=16, recent=4):
        cache = KVPressCache(model.config)
        out = model.generate(ids, cache=cache, **kw)
    assert out.shape == (1, 38) and cache.layers[0].keys_view().shape[:3] == (3, 2, 16)


@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_a_cache_given_under_either_name_is_compressed(argument):
    """transformers 5.2x renamed the forwards' cache argument past_key_values -> cache (the old name deprecated):
    under either name the patched model compresses the cache it is given, and a module that receives no cache
    while its forward was given a KVPressCache raises instead of running uncompressed."""
    import inspect

    model = tiny_model("llama")
    if argument == "cache" and "cache" not in inspect.signature(model.forward).parameters:
        pytest.skip("this transformers release takes past_key_values only")
    ids = torch.randint(3, 128, (1, 64))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        cache = KVPressCache(model.config)
        with warnings.catch_warnings():  # (the old name is what this case gives: transformers warns it is deprecated)
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            model(ids, **{argument: cache})
        assert all(layer.view_width == 32 for layer in cache.layers)


def test_a_module_that_misses_its_cache_raises(monkeypatch):
    from kvpress.integrations import hf, patch

    model = tiny_model("llama")
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        read = hf.given_cache
        monkeypatch.setattr(patch, "given_cache", lambda kwargs: None if "hidden_states" in kwargs else read(kwargs))
        with pytest.raises(RuntimeError, match="ran without the KVPressCache"):
            model(torch.randint(3, 128, (1, 16)), cache=KVPressCache(model.config))
