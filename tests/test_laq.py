"""Lookahead Q-Cache keeps what its definition (docs/policies.md 12.9) names. The references below are independent of
kvpress's LAQ: the pseudo tokens are what transformers' own greedy generate produces on a SnapKV-compressed cache
(stage 1), and the stage-2 kept set is recomputed with plain torch from the queries and keys the attention modules
see (hooked on the unpatched model for the prompt, on the SnapKV-patched model for the pseudo tokens):
observation rows = the prompt's last w2 queries + the pseudo tokens' queries, each softmaxed over the prompt's keys
its position allows, summed, the last w2 columns dropped, max-pooled (kernel 7), averaged over each GQA group; the
top budget - w2 slots plus the last w2 stay."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvpress
from kvpress import KVPressCache
from kvpress.policies import LookaheadQCache

from conftest import tiny_model

L, BUDGET, W2, W1, N_LA = 90, 36, 8, 16, 5


def _prompt(seed=9, n=L):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _kept(cache):
    return [[sorted(layer.key_positions()[0, h][layer.key_valid()[0, h]].tolist())
             for h in range(layer.key_valid().shape[1])] for _, layer in cache.kvpress_layers()]


class Spy(LookaheadQCache):
    """LAQ recording its pseudo tokens (not registered)."""
    seen = []

    def pseudo_tokens(self, run, draft):
        tokens, fed = super().pseudo_tokens(run, draft)
        Spy.seen.append((tokens.clone(), fed.clone()))
        return tokens, fed


def _laq(model, ids, new_tokens=4, **params):
    Spy.seen.clear()
    with kvpress.patch_model(model, Spy(**params)), torch.no_grad():
        cache = KVPressCache(model.config)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             cache=cache)
    return cache, out, Spy.seen[-1] if Spy.seen else None


@pytest.mark.parametrize("budget,kernel", [(BUDGET, 7), (60, 3)])
def test_without_lookahead_it_is_snapkv_with_the_stage_two_window(budget, kernel):
    model = tiny_model("llama")
    ids = _prompt()
    cache, out, _ = _laq(model, ids, budget=budget, lookahead=0, window_size=W2, kernel_size=kernel)
    with kvpress.patch_model(model, "snapkv", budget=budget, window_size=W2, kernel_size=kernel), torch.no_grad():
        snap = KVPressCache(model.config)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             cache=snap)
    assert _kept(cache) == _kept(snap)
    assert out.tolist() == ref.tolist()


def _snapkv_greedy(model, ids, n, budget):
    """transformers' greedy generate over a SnapKV (window W1) cache: stage 1 written with the library's SnapKV."""
    with kvpress.patch_model(model, "snapkv", budget=budget, window_size=W1), torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              cache=KVPressCache(model.config))[0, ids.shape[1]:]


@pytest.mark.parametrize("budget", [BUDGET, 200])  # 200 >= L: stage 1 keeps everything, the full model's tokens
def test_pseudo_tokens_are_the_greedy_continuation_over_the_snapkv_draft(budget):
    model = tiny_model("llama")
    ids = _prompt()
    _, _, (tokens, fed) = _laq(model, ids, budget=budget, lookahead=N_LA, window_size=W2, draft_window=W1)
    expected = _snapkv_greedy(model, ids, N_LA, budget)
    assert bool(fed.all()) and 2 not in expected.tolist()  # this prompt's continuation has no end token
    assert tokens[0].tolist() == expected.tolist()
    if budget >= L:
        with torch.no_grad():
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_LA, do_sample=False)
        assert tokens[0].tolist() == plain[0, L:].tolist()


def test_a_row_stops_feeding_at_its_end_token():
    model = tiny_model("llama")
    ids = _prompt()
    model.generation_config.eos_token_id = int(_snapkv_greedy(model, ids, 3, BUDGET)[2])  # the third token ends
    _, _, (tokens, fed) = _laq(model, ids, budget=BUDGET, lookahead=N_LA, window_size=W2, draft_window=W1)
    assert tokens.shape[1] == 3 and fed[0].tolist() == [True, True, False]


def _attention_inputs(model, run):
    """Run `run()` with every attention module's post-RoPE queries recorded: {layer: [queries [B, Hq, q, D], ...]}."""
    seen = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(*hidden.shape[:2], -1, module.head_dim).transpose(1, 2)
        seen.setdefault(module.layer_idx, []).append(apply_rotary_pos_emb(q, q, cos, sin)[0])

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _reference_kept(model, ids, budget):
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    group, dim = hq // hkv, cfg.hidden_size // hq
    full = DynamicCache()
    prompt_q = _attention_inputs(model, lambda: model(ids, cache=full, use_cache=True))
    tokens = _snapkv_greedy(model, ids, N_LA, budget)

    def pseudo_run():
        with kvpress.patch_model(model, "snapkv", budget=budget, window_size=W1):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_LA + 1, do_sample=False,
                           cache=KVPressCache(model.config))

    pseudo_q = _attention_inputs(model, pseudo_run)  # per layer: the prompt's rows, then one row per fed token
    kept = []
    for layer in range(cfg.num_hidden_layers):
        keys = full.layers[layer].keys[0]  # [Hkv, L, D]
        rows = torch.cat([prompt_q[layer][0][0, :, -W2:], torch.cat([q[0] for q in pseudo_q[layer][1:]], 1)], 1)
        assert rows.shape[1] == W2 + N_LA
        positions = torch.cat([torch.arange(L - W2, L), torch.full((N_LA,), L + 10)])  # pseudo rows see every key
        votes = torch.zeros(hq, L)
        for h in range(hq):
            x = rows[h] @ keys[h // group].T / math.sqrt(dim)
            x = x.masked_fill(torch.arange(L)[None] > positions[:, None], -math.inf)
            votes[h] = x.softmax(-1).sum(0)
        votes[:, L - W2:] = 0
        scores = F.max_pool1d(votes[None], 7, stride=1, padding=3)[0].view(hkv, group, L).mean(1)
        kept.append([sorted(set(range(L - W2, L)) | set(_best(scores[h, :L - W2], budget - W2)))
                     for h in range(hkv)])
    return tokens, kept


def _best(scores, k):
    """The k best slots; a tie (max-pooling makes plateaus) goes to the earlier slot."""
    return scores.sort(descending=True, stable=True).indices[:k].tolist()


@pytest.mark.parametrize("budget", [BUDGET, 24])
def test_stage_two_keeps_what_the_prompt_and_pseudo_queries_attend_to(budget):
    model = tiny_model("llama")
    ids = _prompt()
    cache, _, (tokens, _) = _laq(model, ids, budget=budget, lookahead=N_LA, window_size=W2, draft_window=W1)
    expected_tokens, expected_kept = _reference_kept(model, ids, budget)
    assert tokens[0].tolist() == expected_tokens.tolist()
    assert [[[p for p in h if p < L] for h in layer] for layer in _kept(cache)] == expected_kept  # the prompt's
    assert _kept(cache) != _kept(_laq(model, ids, budget=budget, lookahead=0, window_size=W2)[0])  # the lookahead acts


def test_it_composes_with_a_codec_and_bytes_shrink():
    model = tiny_model("llama")
    ids = _prompt()
    plain, _, _ = _laq(model, ids, new_tokens=1, budget=BUDGET, lookahead=N_LA, window_size=W2, draft_window=W1)
    Spy.seen.clear()
    with kvpress.patch_model(model, "laq+kivi", budget=BUDGET, lookahead=N_LA, window_size=W2, draft_window=W1,
                             bits=4, group_size=16, residual_length=16), torch.no_grad():
        cache = KVPressCache(model.config)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       cache=cache)
    assert _kept(cache) == _kept(plain)  # the codec stores what laq keeps
    assert cache.nbytes() < plain.nbytes()


def test_bad_parameters_and_uses_are_refused():
    model = tiny_model("llama")
    for params, match in ((dict(lookahead=-1), r"laq: lookahead=-1; allowed values: an int >= 0"),
                          (dict(window_size=0), r"laq: window_size=0"),
                          (dict(kernel_size=4), r"laq: kernel_size=4; allowed values: an odd int"),
                          (dict(pooling="sum"), r"laq: pooling='sum'"),
                          (dict(budget=4), r"laq: budget=4 is smaller than window_size=8"),
                          (dict(decode_budget=8), r"laq: decode_budget=8"),
                          (dict(budget_allocation="global"), r"global")):
        with pytest.raises(ValueError, match=match):
            kvpress.patch_model(model, "laq", **{"budget": BUDGET, **params})
    with pytest.raises(ValueError, match=r"prefill_chunk_size=16: laq looks ahead"):
        kvpress.patch_model(model, "laq", budget=BUDGET, prefill_chunk_size=16)
    with pytest.raises(ValueError, match=r"laq: lookahead=8 generates pseudo tokens.*LlamaModel has no LM head"):
        kvpress.patch_model(model.model, "laq", budget=BUDGET)  # a bare decoder: no next-token logits
    with kvpress.patch_model(model, "laq", budget=BUDGET), torch.no_grad():  # a forward that returns a tuple
        cache = KVPressCache(model.config)
        with pytest.raises(ValueError, match=r"laq: lookahead=8 generates from the prompt's next-token logits"):
            model(_prompt(), cache=cache, return_dict=False)
        assert cache.get_seq_length() == 0  # a failed prompt leaves the cache empty, as before it
    with kvpress.patch_model(model.model, "laq", budget=BUDGET, lookahead=0), torch.no_grad():
        cache = KVPressCache(model.config)
        model.model(_prompt(), cache=cache, use_cache=True)
        assert max(max(len(h) for h in layer) for layer in _kept(cache)) == BUDGET
