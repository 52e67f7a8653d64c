"""Keyformer keeps what its definition (docs/policies.md 12.7) names: a recent window of floor(recent_ratio * k) slots
plus the top k - w by the accumulated score f_j = sum over query rows (and the query heads of a KV group) of
softmax((x + G) / tau)_j, x the scaled logits, G Gumbel(0, 1) noise, tau = tau_init + step * tau_delta. The
references below are written from that definition with plain torch, one head at a time."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.policies import H2O, Context, Keyformer

from conftest import greedy, tiny_model

B, HQ, HKV, L, D = 2, 6, 2, 48, 8
G = HQ // HKV


def _prefill(policy, q, k):
    layer = KVPressLayer()
    layer.update(k, torch.randn_like(k))
    ctx = Context(layer_idx=0, layer=layer, phase="prefill", query=q, scaling=D ** -0.5)
    policy.observe(ctx)
    policy.on_prefill(ctx)
    return layer


def _reference_scores(q, k, tau):
    """f [B, Hkv, L]: column sums of the causal softmax(x / tau), summed over each KV head's query heads."""
    f = torch.zeros(B, HKV, L)
    for b in range(B):
        for h in range(HQ):
            x = q[b, h] @ k[b, h // G].T / math.sqrt(D)
            x = x.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
            f[b, h // G] += (x / tau).softmax(-1).sum(0)
    return f


def _kept(layer):
    pos, valid = layer.key_positions(), layer.key_valid()
    return [[set(pos[b, h][valid[b, h]].tolist()) for h in range(HKV)] for b in range(B)]


@pytest.mark.parametrize("tau,budget,recent_ratio", [(1.0, 20, 0.3), (2.0, 16, 0.5), (0.5, 24, 0.0)])
def test_prefill_keeps_the_recent_window_and_the_top_accumulated_scores(tau, budget, recent_ratio):
    torch.manual_seed(0)
    q, k = torch.randn(B, HQ, L, D), torch.randn(B, HKV, L, D)
    layer = _prefill(Keyformer(budget=budget, recent_ratio=recent_ratio, noise=False, tau_init=tau), q, k)
    f = _reference_scores(q, k, tau)
    recent = math.floor(recent_ratio * budget)
    for b, row in enumerate(_kept(layer)):
        for h, kept in enumerate(row):
            window = set(range(L - recent, L))
            others = sorted(set(range(L - recent)), key=lambda j: -float(f[b, h, j]))[:budget - recent]
            assert kept == window | set(others), (b, h)


def test_without_noise_at_temperature_one_it_is_h2o():
    """The definition's stated special case: noise off and tau = 1 keep exactly H2O's slots (same budget split),
    through a real model's prefill and 12 decode steps that each evict."""
    model, ids = tiny_model(), torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, params in [("keyformer", dict(noise=False, tau_delta=0.0, recent_ratio=0.5)), ("h2o", dict(recent=10))]:
        cache = KVPressCache(model.config)
        with kvpress.patch_model(model, name, budget=20, **params):
            tokens = greedy(model, ids, 12, cache=cache)
        runs[name] = tokens.tolist(), [layer.key_positions().tolist() for _, layer in cache.kvpress_layers()]
    assert runs["keyformer"] == runs["h2o"]


def test_the_gumbel_noise_draws_each_slot_with_its_softmax_probability():
    """Gumbel-max: argmax_j (x_j + G_j) lands on i with probability softmax(x)_i. 3000 query rows over the same 6
    logits, each row drawing its own noise from the policy's hash."""
    rows, n = 3000, 6
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    layer = KVPressLayer()
    layer.update(torch.zeros(1, 1, rows, 4), torch.zeros(1, 1, rows, 4))
    ctx = Context(layer_idx=3, layer=layer, phase="prefill", query=torch.zeros(1, 1, rows, 4), scaling=1.0)
    perturb = Keyformer(budget=4)._perturbation(ctx)
    logits = x.expand(1, 1, 1, rows, n).clone()
    perturb(logits, slice(0, rows), n)
    counts = torch.bincount(logits.argmax(-1).flatten(), minlength=n).double()
    expected = x.softmax(0).double() * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)  # chi-square, 5 degrees of freedom: p = 0.001
    # and the noise is fixed by the seed: the same draws again, other draws with another seed
    again = x.expand(1, 1, 1, rows, n).clone()
    perturb(again, slice(0, rows), n)
    other = x.expand(1, 1, 1, rows, n).clone()
    Keyformer(budget=4, seed=1)._perturbation(ctx)(other, slice(0, rows), n)
    assert torch.equal(logits, again) and not torch.equal(logits, other)


def test_decode_holds_the_budget_keeps_the_window_and_never_brings_a_token_back():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    cache, kept_before = KVPressCache(model.config), None
    budget, window = 20, math.floor(0.3 * 20)
    with kvpress.patch_model(model, "keyformer", budget=budget):
        greedy(model, ids, 1, cache=cache)
        for step in range(10):
            seen = cache.get_seq_length()
            nxt = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(step))
            model(nxt, cache=cache)
            for i, layer in cache.kvpress_layers():
                kept = set(layer.key_positions()[0, 0].tolist())
                assert len(kept) == budget and set(range(seen + 1 - window, seen + 1)) <= kept
                if kept_before is not None:
                    assert kept - kept_before[i] <= {seen}  # only the new token is new: discards are permanent
            kept_before = {i: set(layer.key_positions()[0, 0].tolist()) for i, layer in cache.kvpress_layers()}


def test_the_temperature_rises_by_tau_delta_per_decode_step():
    layer = KVPressLayer()
    layer.update(torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4))
    layer.decode_start = 10
    policy = Keyformer(budget=4, tau_init=1.0, tau_delta=0.25)
    prompt = Context(layer_idx=0, layer=layer, phase="prefill", query=torch.zeros(1, 1, 10, 4), scaling=1.0)
    assert policy.temperature(prompt).tolist() == [1.0] * 10
    for step in (1, 2, 3):
        layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
        ctx = Context(layer_idx=0, layer=layer, phase="decode", query=torch.zeros(1, 1, 1, 4), scaling=1.0)
        assert policy.temperature(ctx).tolist() == [1.0 + 0.25 * step]


@pytest.mark.parametrize("params,match", [
    (dict(recent_ratio=1.5), r"recent_ratio=1.5; allowed values: a float in \[0, 1\]"),
    (dict(tau_init=0.0), r"tau_init=0.0; allowed values: a float > 0"),
    (dict(tau_delta=-0.1), r"tau_delta=-0.1; allowed values: a float >= 0"),
])
def test_bad_parameters_are_refused_before_the_model_is_touched(params, match):
    model = tiny_model()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, "keyformer", compression_ratio=0.5, **params)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_a_capture_reserve_is_refused_with_the_reason():
    model = tiny_model()
    with kvpress.patch_model(model, "keyformer", compression_ratio=0.5, slack=4):
        with pytest.raises(ValueError, match="keyformer.*observes each step with shapes that change"):
            model(torch.randint(3, 128, (1, 20)), cache=KVPressCache(model.config, capture_reserve=8))
