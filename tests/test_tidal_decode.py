"""TidalDecode reads what its definition (docs/policies.md 9.6) names: layers below sparse_layer_start read
everything; that layer (and the correction layer) read everything and pick the top `budget` tokens by raw logits per
KV head (max over its query heads); the layers after it read those token positions, and the step's own token."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.policies import Context, TidalDecode

from conftest import greedy, tiny_model

B, HQ, HKV, T, D = 2, 4, 2, 50, 8


def _layer(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, HKV, T, D, generator=g)
    layer = KVPressLayer()
    layer.update(keys, torch.randn(B, HKV, T, D, generator=g))
    return layer, keys


def _read(policy, layer, layer_idx, query, shared):
    ctx = Context(layer_idx=layer_idx, layer=layer, phase="decode", query=query, scaling=D ** -0.5, shared=shared)
    idx, valid = policy.select(ctx)
    return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(HKV)] for b in range(B)]


def _top_positions(query, keys, k):
    """Per row and KV head: the k slots with the largest q . k over the head's query heads (no softmax, no scale)."""
    g = HQ // HKV
    return [[set(torch.stack([keys[b, h] @ query[b, h * g + j, 0] for j in range(g)]).amax(0).topk(k).indices.tolist())
             for h in range(HKV)] for b in range(B)]


def test_the_selection_layer_reads_everything_and_later_layers_read_its_top_positions():
    policy = TidalDecode(budget=10, sparse_layer_start=1, correction_layer=3)
    layers = [_layer(seed) for seed in range(5)]
    queries = [torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(10 + i)) for i in range(5)]
    shared, everything = {}, [[set(range(T))] * HKV] * B
    reads = [_read(policy, layer, i, queries[i], shared) for i, (layer, _) in enumerate(layers)]
    assert reads[0] == everything and reads[1] == everything and reads[3] == everything
    from_1, from_3 = _top_positions(queries[1], layers[1][1], 10), _top_positions(queries[3], layers[3][1], 10)
    own = {T - 1}  # the step's token
    assert reads[2] == [[head | own for head in row] for row in from_1]
    assert reads[4] == [[head | own for head in row] for row in from_3]  # the correction layer's selection
    assert from_1 != from_3


def test_without_a_selection_in_this_forward_a_layer_reads_everything():
    """Layer 4 of a forward whose selection layer is not a kvpress layer (a sliding one): nothing was picked."""
    layer, _ = _layer(0)
    fresh = _read(TidalDecode(budget=10, sparse_layer_start=0, correction_layer=None), layer, 4,
                  torch.randn(B, HQ, 1, D), {})
    assert fresh == [[set(range(T))] * HKV] * B


def test_a_budget_over_the_context_generates_the_plain_tokens_and_a_small_one_reads_less():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(8))
    plain = greedy(model, ids, 8)
    with kvpress.patch_model(model, "tidal_decode", budget=100, sparse_layer_start=0, correction_layer=None):
        assert greedy(model, ids, 8, cache=KVPressCache(model.config)).tolist() == plain.tolist()
    widths, real_select = [], TidalDecode.select

    def recording(self, ctx):
        idx, valid = real_select(self, ctx)
        widths.append((ctx.layer_idx, int(valid.sum(-1).max()), ctx.layer.view_width))
        return idx, valid

    TidalDecode.select = recording
    try:
        with kvpress.patch_model(model, "tidal_decode", budget=12, sparse_layer_start=0, correction_layer=None):
            greedy(model, ids, 4, cache=KVPressCache(model.config))
    finally:
        TidalDecode.select = real_select
    assert {w for i, w, _ in widths if i == 1} == {13} and all(w == t for i, w, t in widths if i == 0)


@pytest.mark.parametrize("params,match", [
    (dict(sparse_layer_start=3, correction_layer=2), r"correction_layer=2; allowed values: None or an int > "
                                                     r"sparse_layer_start=3"),
    (dict(sparse_layer_start=-1), r"sparse_layer_start=-1; allowed values: an int >= 0"),
])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(tiny_model(), "tidal_decode", **params)
