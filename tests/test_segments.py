"""Storage segments against a plain reference model of a layer, and eviction in place at decode.

The reference keeps, per (row, KV head), a dict position -> (key, value, exact?) of the tokens the layer should
hold; random sequences of append / keep / quantize / crop / reorder / in-place eviction drive both, and after
every step the layer's padded view (positions, validity, keys, values) and its bytes are checked against it."""

import dataclasses
import math
import random

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.cache.codecs import encode_kivi
from kvpress.policies import H2O, TOVA, StreamingLLM

from conftest import counter_bytes, greedy, tiny_model

D = 16
GROUP = 8


class Reference:
    """What a layer should hold: per (row, head) {position: (key, value, exact)}; exact False once low-bit."""

    def __init__(self, batch, heads):
        self.tokens = [[{} for _ in range(heads)] for _ in range(batch)]
        self.seen = 0

    def append(self, keys, values, real):
        batch, heads, n, _ = keys.shape
        for b in range(batch):
            for h in range(heads):
                for i in range(n):
                    if real[b, i]:
                        self.tokens[b][h][self.seen + i] = (keys[b, h, i], values[b, h, i], True)
        self.seen += n


def check(layer: KVPressLayer, ref: Reference):
    positions, valid = layer.key_positions(), layer.key_valid()
    keys, values = layer.keys_view(), layer.values_view()
    assert layer.seen == ref.seen
    for b, row in enumerate(ref.tokens):
        for h, held in enumerate(row):
            got = {int(p): i for i, p in enumerate(positions[b, h].tolist()) if valid[b, h, i]}
            assert set(got) == set(held), (b, h)
            for p, (k, v, exact) in held.items():
                tol = dict(atol=0, rtol=0) if exact else dict(atol=0.6, rtol=0)  # 4-bit codes of N(0,1) entries
                torch.testing.assert_close(keys[b, h, got[p]], k, **tol)
                torch.testing.assert_close(values[b, h, got[p]], v, **tol)
    # nbytes() is exactly what the storage allocations hold (no view hides a larger buffer)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for segment in layer.segments for t in segment.tensors()}
    assert layer.nbytes() == sum(storages.values()) + counter_bytes(layer)
    kept = int(valid.sum())
    exact = sum(1 for row in ref.tokens for held in row for _, _, e in held.values() if e)
    if all(not s.low_bit for s in layer.segments):
        assert layer.kv_nbytes() >= kept * 2 * D * 4
    if layer.is_flat and not layer.codes and layer.tail.num_slots == 0:
        assert layer.kv_nbytes() == kept * 2 * D * 4  # flat: exactly the kept tokens
    assert exact <= kept


def _random_keep(layer, ref, rng, per_head):
    """Keep a random subset of each head's real tokens (equal or different counts per head)."""
    positions, valid = layer.key_positions(), layer.key_valid()
    batch, heads = positions.shape[:2]
    n_real = valid.sum(-1)
    fraction = rng.uniform(0.3, 0.9)
    chosen = []
    for b in range(batch):
        for h in range(heads):
            real = [i for i in range(positions.shape[-1]) if valid[b, h, i]]
            n = max(1, int(len(real) * (rng.uniform(0.3, 0.9) if per_head else fraction)))
            chosen.append(sorted(rng.sample(real, min(n, len(real)))))
    width = max(len(c) for c in chosen)
    indices = torch.zeros(batch, heads, width, dtype=torch.long)
    ok = torch.zeros(batch, heads, width, dtype=torch.bool)
    for i, c in enumerate(chosen):
        b, h = divmod(i, heads)
        indices[b, h, :len(c)] = torch.tensor(c)
        ok[b, h, :len(c)] = True
        kept = {int(positions[b, h, j]) for j in c}
        ref.tokens[b][h] = {p: t for p, t in ref.tokens[b][h].items() if p in kept}
    del n_real
    layer.keep(indices, ok)


def _flush(layer, ref, residual) -> bool:
    """KIVI-4 flush; the tokens it moves (the oldest beyond the residual) become approximate in the reference.
    Returns whether it moved any."""
    before = sum(not exact for row in ref.tokens for held in row for _, _, exact in held.values())
    positions, valid = layer.key_positions(), layer.key_valid()
    layer.flush_low_bit(residual, GROUP, lambda k, v, ok, at: encode_kivi(k, v, ok, 4, GROUP))
    low = layer.codes[0] if layer.codes else None
    if low is None:
        return False
    batch, heads = positions.shape[:2]
    low_pos = low.view_positions(0, batch, heads, positions.device)
    low_ok = low.view_valid(batch, heads, positions.device)
    for b in range(batch):
        for h in range(heads):
            for p in low_pos[b, h][low_ok[b, h]].tolist():
                k, v, _ = ref.tokens[b][h][p]
                ref.tokens[b][h][p] = (k, v, False)
    del valid
    return sum(not exact for row in ref.tokens for held in row for _, _, exact in held.values()) > before


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_match_the_reference_layer(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    batch, heads = rng.randint(1, 3), rng.randint(1, 3)
    layer, ref = KVPressLayer(), Reference(batch, heads)
    quantizing = rng.random() < 0.5
    floor = 0  # tokens seen at the last eviction or flush: a crop may not go back before it
    for step in range(14):
        op = rng.choice(["append", "append", "decode", "keep", "keep_heads", "flush", "crop", "reorder", "evict"])
        if layer.seen == 0:
            op = "append"
        if op in ("append", "decode"):
            n = 1 if op == "decode" else rng.randint(2, 24)
            keys, values = torch.randn(batch, heads, n, D, generator=g), torch.randn(batch, heads, n, D, generator=g)
            real = torch.ones(batch, n, dtype=torch.bool)
            if layer.seen == 0 and batch > 1:
                real[-1, :rng.randint(0, n - 1)] = False  # a left-padded row
            layer.update(keys, values, new_valid=real)
            ref.append(keys, values, real)
        elif op in ("keep", "keep_heads"):
            _random_keep(layer, ref, rng, per_head=op == "keep_heads")
            floor = ref.seen
        elif op == "flush" and quantizing:
            if _flush(layer, ref, residual=rng.choice([0, 8, 16])):
                floor = ref.seen
        elif op == "crop":
            n = rng.randint(1, 4)
            try:
                layer.crop(-n)
            except ValueError:
                # refused (and nothing changed, check() below) exactly when the layer evicted or quantized tokens
                # after the point it would go back to: a rollback cannot undo that
                assert ref.seen - n < floor
                check(layer, ref)
                continue
            assert ref.seen - n >= floor
            for row in ref.tokens:
                for held in row:
                    for p in range(ref.seen - n, ref.seen):
                        held.pop(p, None)
            ref.seen -= n
        elif op == "reorder":
            perm = torch.tensor(rng.sample(range(batch), batch))
            layer.reorder_cache(perm)
            ref.tokens = [ref.tokens[i] for i in perm.tolist()]
        elif op == "evict":  # a decode step evicting one token per head in place
            keys, values = torch.randn(batch, heads, 1, D, generator=g), torch.randn(batch, heads, 1, D, generator=g)
            layer.update(keys, values)
            ref.append(keys, values, torch.ones(batch, 1, dtype=torch.bool))
            valid = layer.key_valid()
            victims = torch.stack([torch.stack([torch.tensor(rng.choice(valid[b, h].nonzero().flatten().tolist()))
                                                for h in range(heads)]) for b in range(batch)])
            positions = layer.key_positions()
            dropped = positions.gather(-1, victims[..., None])[..., 0]
            if layer.replace_newest(victims):
                floor = ref.seen
                for b in range(batch):
                    for h in range(heads):
                        ref.tokens[b][h].pop(int(dropped[b, h]))
        check(layer, ref)


def test_flat_low_bit_segments_round_trip_through_rows():
    """Flat low-bit codes (per-head runs) follow batch reorders and keeps like the rest of the layer."""
    g = torch.Generator().manual_seed(3)
    layer = KVPressLayer()
    keys, values = torch.randn(3, 2, 64, D, generator=g), torch.randn(3, 2, 64, D, generator=g)
    layer.update(keys, values)
    counts = torch.tensor([[40, 25], [64, 10], [33, 50]])
    order = torch.stack([torch.randperm(64, generator=g) for _ in range(6)]).view(3, 2, 64)
    indices = order[..., :64]
    ok = torch.arange(64) < counts[..., None]
    layer.keep(indices, ok)
    layer.flush_low_bit(8, GROUP, lambda k, v, o, at: encode_kivi(k, v, o, 4, GROUP))
    assert layer.codes[0].flat and layer.is_flat
    before = {(b, h): set(layer.key_positions()[b, h][layer.key_valid()[b, h]].tolist())
              for b in range(3) for h in range(2)}
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    after = {(b, h): set(layer.key_positions()[b, h][layer.key_valid()[b, h]].tolist())
             for b in range(3) for h in range(2)}
    assert all(after[(b, h)] == before[([2, 0, 1][b], h)] for b in range(3) for h in range(2))


# ---------------------------------------------------------------------------- eviction in place at decode
def _kept(layer):
    """Per KV head of row 0: the sorted positions of the real tokens held."""
    positions, valid = layer.key_positions()[0], layer.key_valid()[0]
    return [sorted(positions[h][valid[h]].tolist()) for h in range(positions.shape[0])]


def _no_in_place(monkeypatch):
    monkeypatch.setattr(KVPressLayer, "replace_newest", lambda self, victims: False)


@pytest.mark.parametrize("policy", [H2O(budget=24, recent=6), TOVA(budget=24), StreamingLLM(n_sink=4, window=20)])
def test_in_place_eviction_keeps_what_copying_keeps_and_never_copies_the_layer(policy, monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    buffers, kept = [], {}
    with kvpress.patch_model(model, policy):
        cache = KVPressCache(model.config)
        out = greedy(model, ids, 50, cache=cache)
        kept["in place"] = [_kept(layer) for layer in cache.layers]
        sorted_flags = [layer.sorted for layer in cache.layers]

        # the buffer address does not change step after step once the layer evicts in place
        def record(module, args, kwargs, output):
            buffers.append(cache.layers[0].tail.data.room[0].data_ptr())

        handle = model.register_forward_hook(record, with_kwargs=True)
        greedy(model, out, 20, cache=cache)
        handle.remove()
    assert len(set(buffers[1:])) == 1
    assert not all(sorted_flags)  # slots really left position order
    with monkeypatch.context() as m:
        _no_in_place(m)
        with kvpress.patch_model(model, policy):
            copying = KVPressCache(model.config)
            assert torch.equal(greedy(model, ids, 50, cache=copying), out)
            kept["copying"] = [_kept(layer) for layer in copying.layers]
    assert kept["in place"] == kept["copying"]
    if isinstance(policy, StreamingLLM):  # the definition: 4 sinks + the 20 newest
        seen = 48 + 49
        assert all(head == list(range(4)) + list(range(seen - 20, seen)) for layer in kept["in place"] for head in layer)


@pytest.mark.parametrize("policy", [H2O(budget=24, recent=6, slack=5), TOVA(budget=24, slack=5),
                                    StreamingLLM(n_sink=4, window=20, slack=5)])
def test_slack_lets_a_layer_grow_k_tokens_then_cuts_it_back_to_the_budget_in_one_step(policy):
    """With slack k, each decode step appends without evicting until a head holds budget + k + 1 tokens; that
    step cuts it back to the budget. Held counts step by step: 25, 26, ..., 29, then 24 again (k = 5), and the
    bytes never exceed those of budget + k tokens. StreamingLLM's held set is its definition at every step: the
    4 sinks plus every newer token not yet cut."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    held, sets, nbytes = [], [], []

    def record(module, args, kwargs, output):
        layer = cache.layers[0]
        held.append(int(layer.key_valid()[0].sum(-1).max()))
        sets.append(_kept(layer))
        nbytes.append(cache.nbytes())

    with kvpress.patch_model(model, policy):
        cache = KVPressCache(model.config)
        handle = model.register_forward_hook(record, with_kwargs=True)
        greedy(model, ids, 20, cache=cache)
        handle.remove()
    # forward 0 is the prompt (cut to 24); forward j >= 1 is decode step j
    assert held == [24] + [24 + (j % 6) for j in range(1, 20)]
    assert all(len(head) == count for heads, count in zip(sets, held) for head in heads)
    capacity = dict(window=25) if isinstance(policy, StreamingLLM) else dict(budget=29)  # 29 = 4 sinks + 25
    with kvpress.patch_model(model, dataclasses.replace(policy, slack=0, **capacity)):
        at_most = KVPressCache(model.config)  # a cache that holds budget + k tokens at every step
        greedy(model, ids, 20, cache=at_most)
    assert max(nbytes) <= at_most.nbytes()
    if isinstance(policy, StreamingLLM):
        for step, heads in enumerate(sets):
            seen = 48 + step
            assert all(head == list(range(4)) + list(range(seen - held[step] + 4, seen)) for head in heads)


def test_attention_over_slots_out_of_order_equals_dense_attention_at_original_positions():
    """After in-place evictions the slots are no longer sorted; the next token's logits equal the stock model
    reading a plain cache of the kept K/V sorted by position, with the new token at its original position."""
    from transformers import DynamicCache

    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with kvpress.patch_model(model, H2O(budget=16, recent=4)):
        cache = KVPressCache(model.config)
        out = greedy(model, ids, 12, cache=cache)
        assert not any(layer.sorted for layer in cache.layers)
        snapshot = []
        for layer in cache.layers:
            order = layer.key_positions()[0, 0].argsort()  # one head's order serves: check all heads below
            positions = layer.key_positions()
            keys = layer.keys_view().gather(2, positions.long().argsort(-1)[..., None].expand(-1, -1, -1, 16))
            values = layer.values_view().gather(2, positions.long().argsort(-1)[..., None].expand(-1, -1, -1, 16))
            snapshot.append((keys.clone(), values.clone(), positions.sort(-1).values.clone()))
            del order
        nxt = out[:, -1:]
        logits = model(nxt, cache=cache).logits
    dense = DynamicCache()
    # per head kept sets differ: build the reference per KV head with the stock eager path and a mask instead
    masks = []
    for i, (k, v, pos) in enumerate(snapshot):
        full_k = torch.zeros(1, 2, 51, 16)
        full_v = torch.zeros(1, 2, 51, 16)
        seen_mask = torch.zeros(1, 2, 51, dtype=torch.bool)
        for h in range(2):
            full_k[0, h, pos[0, h].long()] = k[0, h]
            full_v[0, h, pos[0, h].long()] = v[0, h]
            seen_mask[0, h, pos[0, h].long()] = True
        dense.update(full_k, full_v, i)
        masks.append(seen_mask)

    def masked(module, query, key, value, attention_mask, scaling, **kw):
        allowed = torch.cat([masks[module.layer_idx], torch.ones(1, 2, 1, dtype=torch.bool)], -1)
        allowed = allowed.repeat_interleave(query.shape[1] // key.shape[1], 1)[:, :, None]
        k = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        v = value.repeat_interleave(query.shape[1] // key.shape[1], 1)
        w = (query @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -math.inf).softmax(-1)
        return (w @ v).transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface
    AttentionInterface.register("test_masked_positions", masked)
    model.set_attn_implementation("test_masked_positions")
    try:
        ref = model(nxt, cache=dense, position_ids=torch.tensor([[51]])).logits
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_h2o_holds_a_flat_byte_budget_over_1000_tokens_with_one_spare_slot():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    with kvpress.patch_model(model, H2O(budget=32)):
        cache = KVPressCache(model.config)
        logits = model(ids, cache=cache).logits[:, -1]
        sizes = set()
        for step in range(1000):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
            if step > 2:
                sizes.add(cache.nbytes())
    assert len(sizes) == 1  # flat: the same bytes every step
    per_slot = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    assert all(layer.kv_nbytes() == (32 + 1) * per_slot for layer in cache.layers)  # budget + one spare slot
