"""A serving engine's path (kvpress/integrations/prompts.py): a prompt compressed from plain tensors, chunk by chunk,
keeps the tokens that the transformers path keeps for the same prompt, and evicts whole pages."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvpress
from kvpress.integrations.hf import model_info, with_cache
from kvpress.integrations.prompts import (LayerFacts, PromptCompression, check_servable, evicted_tokens)
from kvpress.policies import resolve_policy
from kvpress.positions import Rotary

from conftest import tiny_model

SERVABLE = {
    "snapkv": dict(window_size=8), "knorm": {}, "keydiff": {}, "random": {}, "streaming_llm": {}, "tova": {},
    "h2o": {}, "expected_attention": dict(n_future_positions=16),
}


def capture(model, ids):
    """Per layer: (query [n, Hq, D], key, value [n, Hkv, D], hidden [n, hidden], scaling) of one forward, as an engine's
    attention sees them (post-RoPE)."""
    seen, hidden = {}, {}

    def attention(module, query, key, value, mask, **kwargs):
        seen[module.layer_idx] = (query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  kwargs.get("scaling", module.scaling))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("kvpress_test_capture", attention)
    base = model.config._attn_implementation
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    hooks = [m.register_forward_pre_hook(lambda m, a, k: hidden.__setitem__(m.layer_idx, k["hidden_states"][0]),
                                         with_kwargs=True) for m in modules]
    model.set_attn_implementation("kvpress_test_capture")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(base)
        for h in hooks:
            h.remove()
    return {i: (*seen[i][:3], hidden[i], seen[i][3]) for i in seen}


def engine_kept(model, policy, ids, chunk, page_size=1):
    """{layer: [Hkv, n] kept positions} through PromptCompression, fed `chunk` tokens at a time."""
    tensors = capture(model, ids)
    prompt = PromptCompression(policy, page_size)
    kept = {}
    for i, (q, k, v, h, scaling) in tensors.items():
        rotary = Rotary.from_config(model.config) if policy.needs().rotary else None
        facts = LayerFacts(i, scaling, rotary=rotary)
        for start in range(0, q.shape[0], chunk):
            end = start + chunk
            prompt.add(facts, q[start:end], k[start:end], v[start:end], h[start:end])
        kept[i] = prompt.finish(facts)
    return kept


def transformers_kept(model, policy, ids):
    with kvpress.patch_model(model, policy), torch.no_grad():
        cache = kvpress.KVPressCache(model.config)
        model(ids, **with_cache(model, cache))
    return {i: layer.key_positions()[0] for i, layer in cache.kvpress_layers()}


@pytest.mark.parametrize("name", sorted(SERVABLE))
@pytest.mark.parametrize("chunk", [100, 13, 5])
def test_chunks_keep_what_the_transformers_path_keeps(name, chunk):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 61), generator=torch.Generator().manual_seed(1))
    policy = resolve_policy(name, compression_ratio=0.6, **SERVABLE[name])
    expected = transformers_kept(model, policy, ids)
    for i, kept in engine_kept(model, policy, ids, chunk).items():
        assert torch.equal(kept.positions, expected[i]), (name, chunk, i)
        assert kept.keys.shape == (expected[i].shape[1], 2, 16)


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming_llm"])
def test_pages_raise_the_budget_to_whole_pages(name):
    """With pages of P tokens, the engine keeps what the transformers path keeps at the raised budget b', and
    evicts a multiple of P: 61 tokens at ratio 0.6 is a budget of 24 (37 evicted); P = 16 evicts 32, keeps 29."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 61), generator=torch.Generator().manual_seed(2))
    policy = resolve_policy(name, compression_ratio=0.6, **SERVABLE[name])
    assert evicted_tokens(policy, 61, 1) == 37 and evicted_tokens(policy, 61, 16) == 32
    expected = transformers_kept(model, resolve_policy(name, budget=29, **SERVABLE[name]), ids)
    for i, kept in engine_kept(model, policy, ids, chunk=20, page_size=16).items():
        assert kept.positions.shape == (2, 29)
        assert torch.equal(kept.positions, expected[i])


def test_evicted_tokens():
    policy = resolve_policy("snapkv", compression_ratio=0.75)
    assert evicted_tokens(policy, 4096, 128) == 3072  # 1024 kept: whole pages already
    assert evicted_tokens(policy, 4000, 128) == 2944  # budget 1000 -> 1056 kept
    assert evicted_tokens(policy, 100, 128) == 0  # under one page evicted: nothing to free
    assert evicted_tokens(resolve_policy("none"), 4096, 128) == 0
    assert evicted_tokens(resolve_policy("knorm", budget=5000), 4096, 16) == 0


@pytest.mark.parametrize("policy, params, message", [
    ("snapkv+kivi", dict(compression_ratio=0.5), "low-bit"),
    ("kivi", {}, "low-bit"),
    ("quest", {}, "read policy"),
    ("kvzip", dict(compression_ratio=0.5), "every layer at once"),
    ("kvzap", dict(compression_ratio=0.5), "every layer at once"),  # its default budget is global
    ("snapkv", dict(compression_ratio=0.5, budget_allocation="pyramid"), "budget_allocation='pyramid'"),
    ("duo_attention", {}, "query rows"),
    ("freqkv", dict(compression_ratio=0.5, cache_local_positions=False), "merges tokens"),
])
def test_what_an_engine_cannot_serve_is_refused(policy, params, message):
    with pytest.raises(ValueError, match=message):
        check_servable(resolve_policy(policy, **params))


def test_paged_decode_cuts_free_whole_pages():
    """(tokens per decode-time cut, tokens held after each): whole pages per cut, or refused; the transformers
    path's schedule (a cut once a head would hold `held + slack + 1`, back to `held`)."""
    tova = resolve_policy("tova", budget=100, slack=15)
    assert tova.paged_decode_cuts(300, 16) == (16, 108)  # the prompt's budget raised to whole evicted pages
    assert tova.paged_decode_cuts(50, 16) == (16, 100)  # a prompt under the budget: the budget, not the prompt
    assert resolve_policy("tova", budget=100, slack=31).paged_decode_cuts(300, 16) == (32, 108)
    keydiff = resolve_policy("keydiff", compression_ratio=0.5, decode_budget=8, slack=15)
    assert keydiff.paged_decode_cuts(300, 16) == (16, 156 + 8)  # prompt kept, then the generated tokens
    for policy in (resolve_policy("tova", budget=100), resolve_policy("snapkv", budget=100), resolve_policy("none")):
        assert policy.paged_decode_cuts(300, 16) == (0, 0)  # the prompt's cut only (one token a step frees no page)
    with pytest.raises(ValueError, match=r"tova: slack=4 .* allowed values: slack = k \* 16 - 1 \(e.g. 15\)"):
        resolve_policy("tova", budget=100, slack=4).paged_decode_cuts(300, 16)
    with pytest.raises(ValueError, match="slack=0 evicts 1 tokens"):
        resolve_policy("keydiff", budget=100, decode_budget=8).paged_decode_cuts(300, 16)


def test_servable_policies_pass():
    for name, params in SERVABLE.items():
        check_servable(resolve_policy(name, compression_ratio=0.5, **params))
    check_servable(resolve_policy("kvzap", compression_ratio=0.5, budget_allocation="uniform"))
    check_servable(resolve_policy("none"))


def test_model_info_of_a_transformers_model_gives_layers_and_rotary():
    model = tiny_model("gemma3")
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    info = model_info(model, modules, 16)
    assert info.layers == [1] and info.folder is None  # layer 0 is a sliding window: transformers' own layer
    positions = torch.arange(9)[None]
    for i in range(len(modules)):  # every layer's RoPE, the sliding one's included
        a = info.rotary(i).cos_sin(positions, torch.zeros(1))
        b = Rotary.from_config(model.config, modules[i].layer_type).cos_sin(positions, torch.zeros(1))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
