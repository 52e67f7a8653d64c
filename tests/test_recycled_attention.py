"""Recycled Attention reads what its definition (docs/policies.md 12.3) names: between full steps, a partial set
C_p of K slots (top K of the last full step's attention of its newest query, max over the GQA group, max-pooled
over 7 slots) that sheds its lowest-scored slot for each token generated since, plus those tokens; a full step
(every `stride` steps, or when the query drifts) reads everything and rebuilds C_p. The reference is plain torch."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.policies import Context, RecycledAttention

from conftest import greedy, tiny_model

B, HQ, HKV, T, D = 2, 6, 2, 60, 8
G = HQ // HKV


def _scores(q_row, keys, kernel=7):
    """[B, Hkv, T]: softmax(q k^T / sqrt(D)) of one query row (it sees every slot), max over the group, then the max
    over each slot's `kernel` neighbours."""
    b, hkv, t, _ = keys.shape
    out = torch.zeros(b, hkv, t)
    for i in range(b):
        for h in range(hkv):
            probs = torch.stack([(q_row[i, h * G + j] @ keys[i, h].T / math.sqrt(D)).softmax(-1) for j in range(G)])
            best = probs.max(0).values
            out[i, h] = torch.stack([best[max(0, s - kernel // 2):s + kernel // 2 + 1].max() for s in range(t)])
    return out


def _top(scores, k):  # the k best slots, ties to the older one
    return [[sorted(range(len(row)), key=lambda s: (-float(row[s]), s))[:k] for row in head] for head in scores]


def _step(policy, layer, query, phase="decode"):
    ctx = Context(layer_idx=0, layer=layer, phase=phase, query=query, scaling=D ** -0.5)
    if phase == "prefill":
        policy.observe(ctx)
        return None
    idx, valid = policy.select(ctx)
    return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(HKV)] for b in range(B)]


def _prompt(seed=0):
    torch.manual_seed(seed)
    keys = torch.randn(B, HKV, T, D)
    layer = KVPressLayer()
    layer.update(keys, torch.randn_like(keys))
    return layer, keys, torch.randn(B, HQ, T, D)


@pytest.mark.parametrize("budget", [10, 25])
def test_partial_steps_read_c_p_shedding_its_lowest_slot_per_generated_token(budget):
    layer, keys, q = _prompt()
    policy = RecycledAttention(budget=budget, stride=100)  # no refresh within the test
    _step(policy, layer, q, "prefill")
    c_p = _top(_scores(q[:, :, -1], keys), budget)
    for g in range(1, 8):
        layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
        read = _step(policy, layer, torch.randn(B, HQ, 1, D))
        generated = set(range(T, T + g))
        assert read == [[set(c_p[b][h][:budget - g]) | generated for h in range(HKV)] for b in range(B)], g


def test_a_full_step_every_stride_steps_reads_everything_and_rebuilds_c_p():
    layer, keys, q = _prompt(1)
    policy = RecycledAttention(budget=12, stride=3)
    _step(policy, layer, q, "prefill")
    full_steps = []
    for step in range(1, 10):
        new_k = torch.randn(B, HKV, 1, D)
        layer.update(new_k, torch.randn(B, HKV, 1, D))
        keys = torch.cat([keys, new_k], 2)
        query = torch.randn(B, HQ, 1, D)
        read = _step(policy, layer, query)
        if read == [[set(range(keys.shape[2]))] * HKV] * B:
            full_steps.append(step)
            c_p, seen = _top(_scores(query[:, :, 0], keys), 12), keys.shape[2]
        elif full_steps:
            g = keys.shape[2] - seen
            assert read == [[set(c_p[b][h][:12 - g]) | set(range(seen, keys.shape[2])) for h in range(HKV)]
                            for b in range(B)]
    assert full_steps == [3, 6, 9]


def test_stride_one_is_dense_attention():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    plain = greedy(model, ids, 10)
    with kvpress.patch_model(model, "recycled_attention", budget=8, stride=1):
        assert greedy(model, ids, 10, cache=KVPressCache(model.config)).tolist() == plain.tolist()


@pytest.mark.parametrize("similarity,expected", [(-1.0, []), (1.5, [2, 4, 6, 8])])
def test_the_query_schedule_refreshes_when_the_query_drifts(similarity, expected):
    """Checked every `stride` steps: s = -1 never refreshes (a cosine is >= -1), s > 1 always does."""
    layer, keys, q = _prompt(2)
    policy = RecycledAttention(budget=12, stride=2, similarity=similarity)
    _step(policy, layer, q, "prefill")
    full = []
    for step in range(1, 9):
        layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
        if _step(policy, layer, torch.randn(B, HQ, 1, D)) == [[set(range(T + step))] * HKV] * B:
            full.append(step)
    assert full == expected


@pytest.mark.parametrize("params,match", [
    (dict(stride=0), r"stride=0; allowed values: an int >= 1"),
    (dict(pool_kernel=4), r"pool_kernel=4; allowed values: an odd int >= 1"),
    (dict(budget=0), r"budget=0; allowed values: an int >= 1"),
])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(tiny_model(), "recycled_attention", **params)
