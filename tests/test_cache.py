"""KVPressLayer / KVPressCache on their own: counters, mask sizes, compaction, rollback, beams, bytes."""

import pytest
import torch

from kvpress import KVPressCache, KVPressLayer
from kvpress.formats.slots import take_slots


def filled(batch=2, heads=3, length=10, dim=4, valid=None):
    layer = KVPressLayer()
    k = torch.randn(batch, heads, length, dim)
    v = torch.randn(batch, heads, length, dim)
    layer.update(k, v, new_valid=valid)
    return layer, k, v


def storage_bytes(layer):
    """Bytes of the distinct allocations behind the layer's storage tensors (views of bigger buffers count whole)."""
    storages = {}
    for t in [t for segment in layer.segments for t in segment.tensors()] + list(layer.policy_stats.values()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_seen_and_mask_sizes_follow_tokens_seen_not_stored():
    layer, _, _ = filled(length=10)
    assert layer.get_seq_length() == 10 and layer.get_mask_sizes(1) == (11, 0)
    layer.keep(torch.tensor([0, 3, 9]).expand(2, 3, 3))
    assert layer.view_width == 3 and layer.get_seq_length() == 10
    assert layer.get_mask_sizes(1) == (4, 7)  # stored + q, seen - stored
    layer.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    assert layer.key_positions()[0, 0].tolist() == [0, 3, 9, 10]


def test_keep_is_per_kv_head_sorted_and_frees_memory():
    layer, k, v = filled(batch=1, heads=2, length=8)
    idx = torch.tensor([[[5, 1, 7], [0, 2, 4]]])
    layer.keep(idx)
    assert layer.key_positions().tolist() == [[[1, 5, 7], [0, 2, 4]]]
    assert torch.equal(layer.keys_view()[0, 0], k[0, 0, [1, 5, 7]])
    assert torch.equal(layer.values_view()[0, 1], v[0, 1, [0, 2, 4]])
    # the storage really shrank: no view onto the old buffer
    keys = layer.keys_view()
    assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    assert layer.nbytes() == storage_bytes(layer)
    assert layer.kv_nbytes() == 2 * 1 * 2 * 3 * 4 * 4


def test_nbytes_counts_every_storage_tensor():
    layer, _, _ = filled()
    assert layer.nbytes() == storage_bytes(layer) == layer.kv_nbytes()
    layer.set_state("score", torch.zeros(2, 3, 10))
    layer.keep(torch.arange(4).expand(2, 3, 4), torch.tensor([True, True, True, False]).expand(2, 3, 4))
    assert layer.key_valid_or_none() is not None and layer.nbytes() == storage_bytes(layer)


def storage_of(t):
    return t.untyped_storage().nbytes()


def test_decode_appends_write_in_place_into_spare_room_counted_by_nbytes():
    layer, k, v = filled(batch=2, heads=3, length=10)
    assert storage_of(layer.keys_view()) == layer.keys_view().numel() * 4  # a prompt is stored exactly
    new = [(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)) for _ in range(70)]
    layer.update(*new[0])
    buffer = layer.keys_view().untyped_storage().data_ptr()
    capacity = storage_of(layer.keys_view()) // (2 * 3 * 4 * 4)
    assert capacity == 11 + 64  # spare room for one-token appends
    for nk, nv in new[1:capacity - 11 + 1]:
        layer.update(nk, nv)
        assert layer.keys_view().untyped_storage().data_ptr() == buffer  # no copy of the layer per token
    assert layer.view_width == capacity
    assert layer.kv_nbytes() == 2 * storage_of(layer.keys_view()) and layer.nbytes() == layer.kv_nbytes()
    layer.update(*new[capacity - 10])  # full: grows once, by a 16th (at least 64 slots)
    assert layer.keys_view().untyped_storage().data_ptr() != buffer
    want = torch.cat([k, *[nk for nk, _ in new[:capacity - 9]]], 2)
    assert torch.equal(layer.keys_view(), want) and layer.view_width == capacity + 1
    assert torch.equal(layer.values_view(), torch.cat([v, *[nv for _, nv in new[:capacity - 9]]], 2))


def test_shallow_copies_never_write_into_a_shared_buffer():
    import copy

    layer, k, _ = filled(batch=1, heads=1, length=4)
    layer.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))  # now owns a buffer with room
    twin = copy.copy(layer)
    layer.crop(-1)  # the original shrinks its view, then appends where the twin still reads
    layer.update(torch.full((1, 1, 1, 4), 2.0), torch.full((1, 1, 1, 4), 2.0))
    twin.update(torch.full((1, 1, 1, 4), 3.0), torch.full((1, 1, 1, 4), 3.0))
    assert layer.keys_view()[0, 0, 4:].tolist() == [[2.0] * 4]
    assert twin.keys_view()[0, 0, 4:].tolist() == [[1.0] * 4, [3.0] * 4]
    assert torch.equal(twin.keys_view()[0, 0, :4], k[0, 0]) and torch.equal(layer.keys_view()[0, 0, :4], k[0, 0])


@pytest.mark.parametrize("source", ["contiguous", "buffer prefix", "transposed"])
def test_keep_takes_the_same_slots_as_a_gather_from_any_layout(source):
    base = torch.randn(2, 3, 12, 8)
    tensor = {"contiguous": base, "buffer prefix": base[:, :, :9],
              "transposed": base.transpose(0, 1).contiguous().transpose(0, 1)}[source]
    indices = torch.stack([torch.randperm(tensor.shape[2])[:5].sort().values for _ in range(6)]).view(2, 3, 5)
    want = tensor.gather(2, indices[..., None].expand(-1, -1, -1, 8))
    assert torch.equal(take_slots(tensor, indices), want)


def test_padding_marks_slots_invalid():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    layer, _, _ = filled(length=4, valid=mask)
    assert layer.key_valid()[:, 0].tolist() == mask.tolist()
    layer.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), new_valid=torch.ones(2, 1, dtype=torch.bool))
    assert layer.tokens_per_head().tolist() == [[3, 3, 3], [5, 5, 5]]


def test_crop_rolls_back_the_tail():
    layer, k, _ = filled(batch=1, heads=1, length=6)
    layer.keep(torch.tensor([[[0, 2, 4, 5]]]))
    layer.update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    layer.crop(-2)
    assert layer.seen == 7 and layer.key_positions().tolist() == [[[0, 2, 4, 5, 6]]]
    assert torch.equal(layer.keys_view()[0, 0, :4], k[0, 0, [0, 2, 4, 5]])
    # back past an eviction: refused (heads evicted different parts of what it would give back), nothing changed
    ragged, _, _ = filled(batch=1, heads=2, length=6)
    ragged.keep(torch.tensor([[[0, 2, 4, 5], [0, 1, 2, 3]]]))
    ragged.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    before = ragged.key_positions().clone()
    with pytest.raises(ValueError, match="changed its stored tokens after 6 tokens"):
        ragged.crop(-2)
    assert ragged.seen == 7 and torch.equal(ragged.key_positions(), before)
    plain, _, _ = filled(length=6)
    plain.crop(4)  # legacy meaning: keep the first 4 seen
    assert plain.seen == 4 and plain.view_width == 4


def test_reorder_cache_selects_rows():
    layer, k, _ = filled(batch=3, length=5)
    layer.keep(torch.tensor([0, 4]).expand(3, 3, 2))
    layer.row_budget = torch.tensor([2, 2, 2])
    layer.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(layer.keys_view()[0], k[2][:, [0, 4]]) and torch.equal(layer.keys_view()[2], k[0][:, [0, 4]])


def test_hybrid_config_keeps_stock_sliding_layers():
    from transformers import Gemma3TextConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cfg = Gemma3TextConfig(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cache = KVPressCache(cfg)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, KVPressLayer, DynamicSlidingWindowLayer]
