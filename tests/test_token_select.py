"""TokenSelect reads what its definition (docs/policies.md 12.2) names: a row's first n_init and last n_local tokens,
and the top_k in between by the soft vote S_j = sum over query heads h of softmax_j(f_h . k_{kv(h), j} / temperature)
over those candidates, f the mean of the step's query rows, kv(h) = h // (Hq / Hkv); one set for every KV head; a
selection reused while cos(f, f_sel) >= reuse_threshold. The reference below is written with plain torch, one head
at a time."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.policies import Context, TokenSelect

from conftest import greedy, tiny_model

B, HQ, HKV, T, D = 2, 6, 2, 80, 8
G = HQ // HKV


def _layer(keys):
    layer = KVPressLayer()
    layer.update(keys, torch.randn_like(keys))
    return layer


def _read(policy, layer, query):
    ctx = Context(layer_idx=0, layer=layer, phase="decode", query=query, scaling=D ** -0.5)
    idx, valid = policy.select(ctx)
    return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(idx.shape[1])] for b in range(idx.shape[0])]


def _reference(query, keys, n_init, n_local, top_k, temperature=1.0):
    out = []
    for b in range(query.shape[0]):
        f = query[b].mean(1)  # [Hq, D]
        candidates = list(range(n_init, keys.shape[2] - n_local))
        votes = torch.zeros(len(candidates))
        for h in range(query.shape[1]):
            s = torch.stack([f[h] @ keys[b, h // (query.shape[1] // keys.shape[1]), j] for j in candidates])
            votes += (s / temperature).softmax(0)
        top = {candidates[i] for i in votes.topk(top_k).indices.tolist()}
        out.append(set(range(n_init)) | top | set(range(keys.shape[2] - n_local, keys.shape[2])))
    return out


@pytest.mark.parametrize("n_init,n_local,top_k,temperature", [(4, 8, 12, 1.0), (0, 1, 20, 0.5), (16, 4, 5, 3.0)])
def test_reads_the_sinks_the_window_and_the_soft_voted_top_k(n_init, n_local, top_k, temperature):
    torch.manual_seed(0)
    keys, query = torch.randn(B, HKV, T, D), torch.randn(B, HQ, 1, D) * 2
    policy = TokenSelect(budget=n_init + n_local + top_k, n_init=n_init, n_local=n_local, temperature=temperature)
    read, expected = _read(policy, _layer(keys), query), _reference(query, keys, n_init, n_local, top_k, temperature)
    for b in range(B):
        assert read[b] == [expected[b]] * HKV  # every KV head reads the same slots


def test_with_one_head_the_vote_is_the_exact_top_k_by_q_dot_k():
    torch.manual_seed(1)
    keys, query = torch.randn(1, 1, T, D), torch.randn(1, 1, 1, D)
    read = _read(TokenSelect(budget=10, n_init=0, n_local=1), _layer(keys), query)
    exact = set((keys[0, 0, :-1] @ query[0, 0, 0]).topk(9).indices.tolist()) | {T - 1}
    assert read[0][0] == exact


def test_the_soft_vote_is_not_decided_by_one_head_with_huge_logits():
    """Head 0 (huge logits) prefers slot 10; heads 1-5 (moderate) all prefer slot 20: a sum of logits picks 10, the
    sum of per-head softmaxes picks 20 (the reason for the vote)."""
    keys = torch.zeros(1, HKV, T, D)
    keys[0, :, 10, 0], keys[0, :, 20, 1] = 1.0, 1.0
    query = torch.zeros(1, HQ, 1, D)
    query[0, 0, 0, 0] = 100.0
    query[0, 1:, 0, 1] = 5.0
    read = _read(TokenSelect(budget=2, n_init=0, n_local=1, reuse_threshold=2.0), _layer(keys), query)
    assert read[0][0] == {20, T - 1}


def test_the_selection_is_reused_while_the_query_stays_close():
    torch.manual_seed(2)
    keys = torch.randn(1, HKV, T, D)
    q1 = torch.randn(1, HQ, 1, D)
    q2 = q1 + 0.01 * torch.randn_like(q1)  # cos(q1, q2) ~ 1
    q3 = torch.randn(1, HQ, 1, D)  # unrelated
    fresh = [_read(TokenSelect(budget=20, n_init=2, n_local=4, reuse_threshold=2.0), _layer(keys), q) for q in (q1, q3)]
    for threshold, expected in [(2.0, fresh), (-1.0, [fresh[0], fresh[0]]), (0.9, [fresh[0], fresh[1]])]:
        layer, policy = _layer(keys), TokenSelect(budget=20, n_init=2, n_local=4, reuse_threshold=threshold)
        first = _read(policy, layer, q1)
        assert first == fresh[0]
        assert _read(policy, layer, q2) == fresh[0]  # close: reused (or, never reusing, the same vote anyway)
        assert _read(policy, layer, q3) == expected[1], threshold


def test_a_budget_over_the_context_reads_everything_and_generates_the_plain_tokens():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    plain = greedy(model, ids, 10)
    with kvpress.patch_model(model, "token_select", budget=200):
        assert greedy(model, ids, 10, cache=KVPressCache(model.config)).tolist() == plain.tolist()


def test_decoding_reads_at_most_the_budget():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    widths = []
    policy = TokenSelect(budget=24, n_init=2, n_local=6)
    real_select = TokenSelect.select

    def recording(self, ctx):
        idx, valid = real_select(self, ctx)
        widths.append(int(valid.sum(-1).max()))
        return idx, valid

    TokenSelect.select = recording
    try:
        with kvpress.patch_model(model, policy):
            greedy(model, ids, 8, cache=KVPressCache(model.config))
    finally:
        TokenSelect.select = real_select
    assert widths and max(widths) == 24


@pytest.mark.parametrize("params,match", [
    (dict(budget=10, n_init=4, n_local=6), r"budget=10 leaves no top_k .* allowed values: budget > n_init \+ n_local"),
    (dict(pool_kernel=4), r"pool_kernel=4; allowed values: 0 \(off\) or an odd int >= 1"),
    (dict(temperature=0.0), r"temperature=0.0; allowed values: a float > 0"),
    (dict(n_local=-1), r"n_local=-1; allowed values: None or an int >= 0"),
])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(tiny_model(), "token_select", **params)
