"""Query-agnostic selection (KVzip, ExpectedAttention, KeyDiff), the model-level hook, declared needs, and reusing one
compressed cache for several questions. References are written from the definitions (docs/policies.md section 11)
with plain loops over heads and the stock model, not with kvpress code."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kvpress
from kvpress import KVPressCache
from kvpress.policies import KIVI, ExpectedAttention, KeyDiff, KVzip
from kvpress.policies.kvzip import NO_TEMPLATE_SUFFIX, ReplayPrompt

from conftest import TOK, greedy, tiny_model


def _inputs(seed=0, batch=2, length=70, pad=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # generate's convention for left padding
    return ids, mask, positions


def _capture_scores(monkeypatch):
    captured = {}
    real_evict = KVzip.evict

    def spy(self, run, scores):
        captured.update({i: s.clone() for i, s in scores.items()})
        real_evict(self, run, scores)

    monkeypatch.setattr(KVzip, "evict", spy)
    return captured


# ---------------------------------------------------------------------------- KVzip
def _reference_kvzip_scores(model, ids, mask, chunk_size, n_sink):
    """Per row, from the definition: the stock model runs [row's real tokens, replay of chunk i] (positions
    0, 1, ...); in every layer each replay query's softmax is taken over sinks + chunk i + replay tokens up to
    itself; a chunk token's score is the max over replay queries and the query heads of its KV head."""
    captured = {}

    def capture(module, query, key, value, attention_mask, scaling, **kw):
        captured[module.layer_idx] = (query.detach(), key.detach(), scaling)
        return AttentionInterface._global_mapping["sdpa"](module, query, key, value, attention_mask,
                                                            scaling=scaling, **kw)

    AttentionInterface.register("test_capture", capture)
    prompt = ReplayPrompt.from_tokenizer(TOK)
    hkv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // hkv
    out = {}
    model.set_attn_implementation("test_capture")
    try:
        for b in range(ids.shape[0]):
            tokens = ids[b][mask[b].bool()].tolist()
            n = len(tokens)
            scores = torch.zeros(model.config.num_hidden_layers, hkv, n)
            for i in range(math.ceil(n / chunk_size)):
                chunk = tokens[i * chunk_size:(i + 1) * chunk_size]
                lead = list(prompt.first) if i == 0 else list(prompt.next) + tokens[i * chunk_size - 8:i * chunk_size]
                replay = lead + list(prompt.suffix) + chunk
                model(torch.tensor([tokens + replay]))
                r = len(replay)
                keep_keys = list(range(min(n_sink, n))) + list(range(i * chunk_size, i * chunk_size + len(chunk)))
                keep_keys = sorted(set(keep_keys))
                for layer, (q, k, scaling) in captured.items():
                    for h in range(hkv):
                        for j in range(group):
                            for row in range(r):
                                keys = keep_keys + list(range(n, n + row + 1))
                                logits = (q[0, h * group + j, n + row] @ k[0, h, keys].T) * scaling
                                probs = logits.softmax(-1)
                                for col, key in enumerate(keys[:len(keep_keys)]):
                                    if i * chunk_size <= key < i * chunk_size + len(chunk):
                                        scores[layer, h, key] = max(scores[layer, h, key], probs[col])
            scores[:, :, :min(n_sink, n)] = math.inf
            out[b] = scores
    finally:
        model.set_attn_implementation("sdpa")
    return out


def test_kvzip_scores_equal_the_definition(monkeypatch):
    model = tiny_model("llama")  # 4 query heads over 2 KV heads
    ids, mask, positions = _inputs(seed=1, length=40, pad=7)
    captured = _capture_scores(monkeypatch)
    with kvpress.patch_model(model, "kvzip", compression_ratio=0.5, chunk_size=16, tokenizer=TOK):
        model(ids, attention_mask=mask, position_ids=positions, cache=KVPressCache(model.config))
    reference = _reference_kvzip_scores(model, ids, mask, chunk_size=16, n_sink=4)
    for layer, scores in captured.items():
        for b in range(2):
            real = mask[b].bool()
            torch.testing.assert_close(scores[b][:, real], reference[b][layer], atol=2e-5, rtol=1e-4)
            assert bool((scores[b][:, ~real] == 0).all())  # padding is never scored


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_after_the_replay_the_cache_equals_one_built_from_the_kept_slots(allocation):
    """seen, positions, the kept K/V and the next token's logits are bit-identical to a cache prefilled without
    compression and then cut to the same slots: the replay left nothing behind."""
    model = tiny_model("qwen3")
    ids, mask, positions = _inputs(seed=2)
    nxt = torch.tensor([[9], [11]])
    mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
    with kvpress.patch_model(model, "kvzip", compression_ratio=0.6, chunk_size=24, budget_allocation=allocation,
                             tokenizer=TOK):
        cache = KVPressCache(model.config)
        model(ids, attention_mask=mask, position_ids=positions, cache=cache)
        kept = [(layer.key_positions().clone(), layer.key_valid().clone()) for layer in cache.layers]
        logits = model(nxt, attention_mask=mask2, position_ids=positions[:, -1:] + 1, cache=cache).logits
    direct = KVPressCache(model.config)
    with kvpress.patch_model(model, "none"):
        model(ids, attention_mask=mask, position_ids=positions, cache=direct)
        for layer, (pos, valid) in zip(direct.layers, kept):
            layer.keep(pos.long(), valid)
        snapshot = [(l.seen, l.key_positions(), l.key_valid(), l.keys_view(), l.values_view()) for l in direct.layers]
        want = model(nxt, attention_mask=mask2, position_ids=positions[:, -1:] + 1, cache=direct).logits
    for (seen, pos, valid, k, v), (kp, kv) in zip(snapshot, kept):
        assert seen == 70 and torch.equal(pos, kp) and torch.equal(valid, kv)
    for layer, (seen, pos, valid, k, v) in zip(cache.layers, snapshot):
        assert layer.seen == 71
        assert torch.equal(layer.key_positions()[..., :pos.shape[-1]], pos)
        assert torch.equal(layer.keys_view()[:, :, :k.shape[2]], k)
        assert torch.equal(layer.values_view()[:, :, :v.shape[2]], v)
    assert torch.equal(logits, want)


def test_global_budget_keeps_the_model_wide_top_scores_and_frees_their_bytes(monkeypatch):
    model = tiny_model("llama")
    ids, mask, positions = _inputs(seed=3, length=80, pad=11)
    captured = _capture_scores(monkeypatch)
    with kvpress.patch_model(model, "kvzip", compression_ratio=0.75, chunk_size=32, tokenizer=TOK):
        cache = KVPressCache(model.config)
        model(ids, attention_mask=mask, position_ids=positions, cache=cache)
    layers = cache.layers
    n_real = mask.sum(-1)
    budget = n_real - torch.ceil(n_real.double() * 0.75).long()  # never a token over the ratio
    heads, dim = 2, 16
    for b in range(2):
        kept = [set(layer.key_positions()[b, h][layer.key_valid()[b, h]].tolist())
                for layer in layers for h in range(heads)]
        assert sum(map(len, kept)) == int(budget[b]) * len(layers) * heads  # the model-wide total
        scores = [captured[i][b, h] for i in range(len(layers)) for h in range(heads)]
        real = mask[b].bool().nonzero().flatten().tolist()
        kept_scores = [float(s[p]) for s, k in zip(scores, kept) for p in k]
        dropped = [float(s[p]) for s, k in zip(scores, kept) for p in real if p not in k]
        assert min(kept_scores) >= max(dropped)  # one threshold across every layer and head
        assert all(set(real[:4]) <= k for k in kept)  # sinks
    per_head = [int(c) for layer in layers for c in layer.tokens_per_head().flatten()]
    assert len(set(per_head)) > 1  # non-uniform: heads and layers keep different counts
    for layer in layers:  # a layer whose heads keep different counts is flat (no padding); one whose rows differ
        counts = layer.tokens_per_head()  # only from each other stays rectangular, fillers like the prompt's padding
        slots = int(counts.sum()) if layer.is_flat else counts.numel() * int(counts.max())
        assert layer.kv_nbytes() == slots * 2 * dim * 4
    assert any(layer.is_flat for layer in layers)


def test_kvzip_chunked_prefill_holds_budget_plus_one_chunk_and_its_share():
    from conftest import record_held_tokens

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 240), generator=torch.Generator().manual_seed(4))
    with record_held_tokens() as held, kvpress.patch_model(model, "kvzip", compression_ratio=0.8, chunk_size=32,
                                                           tokenizer=TOK, prefill_chunk_size=60):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    budget = 240 - int(240 * 0.8)  # 48 per layer and head, 96 per layer, 192 in all
    assert sum(int(layer.tokens_per_head().sum()) for layer in cache.layers) == 2 * 2 * budget
    # per layer: at most the whole budget spread over its heads (global) + one prompt chunk + one replay chunk
    assert max(held) <= 2 * budget + 60 + len(ReplayPrompt.from_tokenizer(TOK).first) + 1 + 32


def test_kvzip_composes_with_a_codec_after_its_global_selection():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(5))
    with kvpress.patch_model(model, "kvzip+kivi", compression_ratio=0.5, bits=4, group_size=16, residual_length=16,
                             tokenizer=TOK):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
        total = sum(int(layer.tokens_per_head().sum()) for layer in cache.layers)
        assert total == 2 * 2 * 80  # the budget, after selection
        for layer in cache.layers:
            low = layer.codes[0] if layer.codes else None
            assert low is not None and low.flat and bool((low.lengths % 16 == 0).all())
        out = greedy(model, ids, 4)
    assert out.shape == (1, 164)


# ---------------------------------------------------------------------------- reuse
def test_two_questions_on_one_compressed_cache_equal_two_separate_compressions():
    model = tiny_model("llama")
    context = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(6))
    questions = [torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(7 + i)) for i in range(2)]
    for policy, params in [("kvzip", dict(tokenizer=TOK, chunk_size=32)), ("expected_attention", {}),
                           ("keydiff", {}), ("snapkv", dict(window_size=8))]:
        with kvpress.patch_model(model, policy, compression_ratio=0.7, **params):
            shared = KVPressCache(model.config)
            model(context, cache=shared)
            before = shared.nbytes()
            answers = [greedy(model, torch.cat([context, q], 1), 6, cache=shared.fork()) for q in questions]
            assert shared.nbytes() == before and shared.get_seq_length() == 90  # forks never touch the original
            for q, got in zip(questions, answers):
                alone = KVPressCache(model.config)
                model(context, cache=alone)
                assert torch.equal(greedy(model, torch.cat([context, q], 1), 6, cache=alone), got), policy


# ---------------------------------------------------------------------------- ExpectedAttention, KeyDiff
def _pre_rope_queries(model, ids):
    """Per layer, the pre-RoPE queries q_proj(h) (+ q_norm) from the attention input, by a hook."""
    out = {}

    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        q = module.q_proj(h).view(*h.shape[:2], -1, module.head_dim)
        if hasattr(module, "q_norm"):
            q = module.q_norm(q)
        out[module.layer_idx] = q.transpose(1, 2).detach()

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_expected_attention_keeps_its_definition_s_top_slots(arch, monkeypatch):
    """The definition (NVIDIA kvpress's): the softmax of the expected logits runs over the keys after the first
    n_sink, which are kept whatever their score. Checked on the scores themselves and on the kept slots."""
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(8))
    queries = _pre_rope_queries(model, ids)
    scored = {}
    real_score = ExpectedAttention.score

    def recording_score(self, ctx):
        scored[ctx.layer_idx] = out = real_score(self, ctx)
        return out

    monkeypatch.setattr(ExpectedAttention, "score", recording_score)
    with kvpress.patch_model(model, "expected_attention", compression_ratio=0.5, n_future_positions=32,
                             use_covariance=True):  # NVIDIA kvpress's default, with the covariance term
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    with kvpress.patch_model(model, "none"):
        full = KVPressCache(model.config)
        model(ids, cache=full)
    rotary = model.model.rotary_emb
    hkv, hq = 2, 4
    group = hq // hkv
    for i, layer in enumerate(cache.layers):
        keys, values = full.layers[i].keys_view()[0].detach().float(), full.layers[i].values_view()[0].detach().float()
        q = queries[i][0, :, 4:].double()  # sinks skipped
        dim = q.shape[-1]
        cos, sin = rotary(q.float(), torch.arange(64, 64 + 32)[None])
        half = torch.cat([torch.zeros(dim // 2, dim // 2), -torch.eye(dim // 2)], 1)
        half = torch.cat([half, torch.cat([torch.eye(dim // 2), torch.zeros(dim // 2, dim // 2)], 1)], 0)
        rotations = [torch.diag(cos[0, p]) + torch.diag(sin[0, p]) @ half for p in range(32)]
        r_bar = torch.stack(rotations).mean(0).double()
        scale = dim ** -0.5
        scores = torch.zeros(hkv, 64)
        for h in range(hkv):
            per_head = []
            for j in range(group):
                qh = q[h * group + j]
                mu, cov = qh.mean(0), torch.cov(qh.T, correction=0)
                mu, cov = r_bar @ mu, r_bar @ cov @ r_bar.T
                k = keys[h].double()
                logits = scale * k @ mu + scale ** 2 * torch.einsum("td,de,te->t", k, cov, k) / 2
                logits[:4] = -math.inf  # the sinks: outside the softmax
                per_head.append(logits.softmax(-1))
            scores[h] = (torch.stack(per_head).mean(0) * values[h].double().norm(dim=-1)).float()
        torch.testing.assert_close(scored[i][0, :, 4:], scores[:, 4:], rtol=1e-3, atol=1e-6)
        for h in range(hkv):
            kept = set(layer.key_positions()[0, h].tolist())
            assert len(kept) == 32 and set(range(4)) <= kept
            free = sorted(set(range(4, 64)), key=lambda p: -float(scores[h, p]))
            want = set(free[:28])
            margin = float(scores[h, free[27]] - scores[h, free[28]])
            assert kept - set(range(4)) == want or margin < 1e-6, (i, h)


def test_keydiff_keeps_the_keys_least_like_their_head_s_mean_direction():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(9))
    with kvpress.patch_model(model, "none"):
        full = KVPressCache(model.config)
        model(ids, cache=full)
    with kvpress.patch_model(model, "keydiff", budget=20):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    for layer, ref in zip(cache.layers, full.layers):
        keys = ref.keys_view()[0].detach().double()
        for h in range(2):
            units = [k / k.norm() for k in keys[h]]
            anchor = sum(units) / len(units)
            score = [-float(k @ anchor / (k.norm() * anchor.norm())) for k in keys[h]]
            want = set(sorted(range(50), key=lambda p: -score[p])[:20])
            assert set(layer.key_positions()[0, h].tolist()) == want


@pytest.mark.parametrize("policy", ["expected_attention", "keydiff"])
def test_decode_budget_and_chunked_prefill_use_the_query_agnostic_scorers(policy):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(10))
    with kvpress.patch_model(model, policy, compression_ratio=0.75, decode_budget=10, prefill_chunk_size=40):
        cache = KVPressCache(model.config)
        greedy(model, ids, 40, cache=cache)
    for layer in cache.layers:
        assert bool((layer.tokens_per_head() == 30 + 10).all())  # prompt budget + decode budget


# ---------------------------------------------------------------------------- declarations
class NeedsEverything(kvpress.policies.Knorm):
    """A scorer that declares rotary + hidden states and records what it was given."""

    name = "needs_everything_test"
    seen = []

    def needs(self):
        return kvpress.policies.base.Needs(rotary=True, hidden_states=True)

    def score(self, ctx):
        type(self).seen.append((ctx.rotary is not None, ctx.hidden_states is not None,
                                tuple(ctx.pre_rope_query().shape)))
        return super().score(ctx)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_pre_rope_queries_from_the_declared_rotary_equal_the_projection(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(11))
    want = _pre_rope_queries(model, ids)
    got = {}

    class Spy(NeedsEverything):
        def score(self, ctx):
            got[ctx.layer_idx] = ctx.pre_rope_query()
            return super().score(ctx)

    with kvpress.patch_model(model, Spy(budget=10)):
        model(ids, cache=KVPressCache(model.config))
    assert got and all(torch.allclose(got[i], want[i].float(), atol=1e-5) for i in got)


def test_declared_needs_reach_the_policy_through_compositions_and_the_eval_engine():
    from evals.engine import Config, answer, decode_batches, prefill
    from kvpress.policies.registry import _REGISTRY

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(12))
    NeedsEverything.seen = []
    for policy in [NeedsEverything(budget=20), [NeedsEverything(budget=20), KIVI(bits=4, group_size=16)]]:
        with kvpress.patch_model(model, policy):
            model(ids, cache=KVPressCache(model.config))
    _REGISTRY[NeedsEverything.name] = NeedsEverything
    try:
        configs = [Config(NeedsEverything.name, 0.5), Config("snapkv", 0.5)]
        pre = prefill(model, ids, configs)
        for batch, policy in decode_batches(pre, configs):
            answer(model, pre, batch, policy, None, 2, set())
    finally:
        del _REGISTRY[NeedsEverything.name]
    assert len(NeedsEverything.seen) == 3 * 2 and all(r and h for r, h, _ in NeedsEverything.seen)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="kvzip", compression_ratio=0.5, chunk_size=0, tokenizer=TOK), r"kvzip: chunk_size=0; allowed"),
    (dict(policy="kvzip", compression_ratio=1.0, tokenizer=TOK), r"compression_ratio=1.0 is outside .*\[0, 1\)"),
    (dict(policy="kvzip", compression_ratio=-0.1, tokenizer=TOK), r"compression_ratio=-0.1 is outside"),
    (dict(policy="kvzip", compression_ratio=0.5), r"kvzip: tokenizer=None and no tokenizer could be loaded"),
    (dict(policy="kvzip", compression_ratio=0.5, decode_budget=64, tokenizer=TOK), r"decode_budget=64.*None"),
    (dict(policy="kvzip+quest", compression_ratio=0.5, tokenizer=TOK), r"'quest' is a read policy"),
    (dict(policy="snapkv", compression_ratio=0.5, budget_allocation="global"), r"budget_allocation='global'.*allowed"),
    (dict(policy="expected_attention", compression_ratio=0.5, n_future_positions=0), r"n_future_positions=0"),
])
def test_bad_query_agnostic_input_raises_before_the_model_is_touched(kwargs, match):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, **kwargs)
    assert model.config._attn_implementation == before and "generate" not in model.__dict__


def test_a_tokenizer_without_a_chat_template_gets_the_documented_fallback():
    prompt = ReplayPrompt.from_tokenizer(TOK)
    assert prompt.suffix == tuple(TOK.encode(NO_TEMPLATE_SUFFIX))
    assert prompt.first == tuple(TOK.encode("\n\nRepeat the previous context exactly."))


@pytest.mark.real_model
def test_smollm2_replay_prompt_uses_its_chat_template(smollm2):
    _, tok = smollm2
    prompt = ReplayPrompt.from_tokenizer(tok)
    assert tok.decode(list(prompt.suffix)) == "<|im_end|>\n<|im_start|>assistant\n"
