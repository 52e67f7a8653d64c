"""ZipCache keeps what its definition (docs/policies.md 12.8) names: saliency s~_j = (attention to j summed over
probe rows and a KV group's query heads) / (probes at positions >= j); per KV head, the round(0.4 n / g) * g least
salient slots of a flushed block in 2-bit codes, the rest in 4-bit ones. The references are written from that
definition with plain torch, one head at a time."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressLayer
from kvpress.cache.codecs import encode_kivi
from kvpress.policies import Context, ZipCache

from conftest import TOK, greedy, tiny_model

B, HQ, HKV, L, D = 2, 4, 2, 96, 16
G = HQ // HKV


def _prefill(policy, q, k, v):
    layer = KVPressLayer()
    layer.update(k, v)
    ctx = Context(layer_idx=0, layer=layer, phase="prefill", query=q, scaling=D ** -0.5)
    policy.observe(ctx)
    policy.on_prefill(ctx)
    return layer, ctx


def _exact_saliency(q, k):
    """Every row a probe: column sums of the causal softmax, over each KV head's query heads, / (L - j)."""
    s = torch.zeros(B, HKV, L)
    for b in range(B):
        for h in range(HQ):
            x = q[b, h] @ k[b, h // G].T / math.sqrt(D)
            x = x.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
            s[b, h // G] += x.softmax(-1).sum(0)
    return s / (L - torch.arange(L)).float()


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g),
            torch.randn(B, HKV, L, D, generator=g))


def test_every_row_as_a_probe_gives_the_exact_normalised_attention():
    q, k, v = _qkv()
    layer = KVPressLayer()
    layer.update(k, v)
    ctx = Context(layer_idx=0, layer=layer, phase="prefill", query=q, scaling=D ** -0.5)
    saliency = ZipCache(recent_ratio=1.0).probe_saliency(ctx)
    torch.testing.assert_close(saliency, _exact_saliency(q, k), rtol=1e-5, atol=1e-6)


def test_probes_are_the_recent_tokens_and_draws_from_the_earlier_ones():
    q, k, v = _qkv()
    layer = KVPressLayer()
    layer.update(k, v)
    ctx = Context(layer_idx=3, layer=layer, phase="prefill", query=q, scaling=D ** -0.5)
    rows, weight = ZipCache(recent_ratio=0.1, random_ratio=0.2).probes(ctx)
    recent, drawn = math.ceil(0.1 * L), math.ceil(0.2 * L)
    assert rows.shape == (B, recent + drawn) and bool((weight == 1).all())
    assert rows[:, :recent].tolist() == [list(range(L - recent, L))] * B
    assert bool((rows[:, recent:] < L - recent).all())
    assert len(set(rows[0, recent:].tolist())) > drawn // 2  # random draws, not one repeated row


@pytest.mark.parametrize("low_ratio", [0.4, 0.25])
def test_the_least_salient_slots_of_each_head_go_to_the_low_width(low_ratio):
    q, k, v = _qkv(1)
    policy = ZipCache(recent_ratio=1.0, low_ratio=low_ratio, group_size=8)
    layer, _ = _prefill(policy, q, k, v)
    saliency = _exact_saliency(q, k)
    n_low = int(low_ratio * L / 8 + 0.5) * 8
    high, low = layer.codes
    assert (high.data.bits, low.data.bits) == (4, 2) and low.num_slots == n_low and high.num_slots == L - n_low
    for b in range(B):
        for h in range(HKV):
            expect = sorted(saliency[b, h].argsort()[:n_low].tolist())
            assert low.positions[b, h].tolist() == expect
            assert high.positions[b, h].tolist() == sorted(set(range(L)) - set(expect))
    # each width holds its tokens as KIVI would store them alone, in position order
    for segment, bits in ((high, 4), (low, 2)):
        idx = segment.positions.long()
        ref = encode_kivi(k.gather(2, idx[..., None].expand(-1, -1, -1, D)),
                          v.gather(2, idx[..., None].expand(-1, -1, -1, D)),
                          torch.ones_like(idx, dtype=torch.bool), bits, 8)
        torch.testing.assert_close(segment.data.dequantize(0, segment.num_slots), ref.dequantize(0, ref.num_slots))


def test_bytes_are_the_two_widths_shares():
    q, k, v = _qkv(2)
    layer, _ = _prefill(ZipCache(group_size=8), q, k, v)
    high, low = layer.codes
    per_slot = {bits: B * HKV * (2 * D * bits // 8 + 2 * 2 * D // 8) for bits in (4, 2)}  # codes + value scale/min
    per_group = B * HKV * 2 * 2 * D  # a key group: fp16 scale and min per channel
    for segment, bits in ((high, 4), (low, 2)):
        assert segment.kv_nbytes() == segment.num_slots * per_slot[bits] + segment.num_slots // 8 * per_group
    assert layer.kv_nbytes() == high.kv_nbytes() + low.kv_nbytes()  # nothing left in full precision (residual 0)


@pytest.mark.parametrize("low_ratio, width", [(0.4, 0), (0.5, 1)])
def test_a_decode_block_of_one_group_goes_to_one_width(low_ratio, width):
    """round(low_ratio * 8 / 8) groups of a one-group block go low: none at 0.4, the whole block at 0.5."""
    q, k, v = _qkv(3)
    policy = ZipCache(recent_ratio=1.0, group_size=8, low_ratio=low_ratio)
    layer, _ = _prefill(policy, q[:, :, :L - 8], k[:, :, :L - 8], v[:, :, :L - 8])
    before = [c.num_slots for c in layer.codes]
    for step in range(L - 8, L):  # the 8th decode step fills a group, which its flush moves
        layer.update(k[:, :, step:step + 1], v[:, :, step:step + 1])
        policy.on_decode(Context(layer_idx=0, layer=layer, phase="decode", query=q[:, :, step:step + 1],
                                 scaling=D ** -0.5))
        assert layer.tail.num_slots == (step - L + 9) % 8
    grown = [c.num_slots - n for c, n in zip(layer.codes, before)]
    assert grown == [8 if i == width else 0 for i in range(2)]
    assert layer.codes[width].positions[0, 0, -8:].tolist() == list(range(L - 8, L))


def test_decode_blocks_of_several_groups_split_by_the_query():
    q, k, v = _qkv(4)
    policy = ZipCache(recent_ratio=1.0, group_size=4, residual_length=0, low_ratio=0.5)
    layer, _ = _prefill(policy, q[:, :, :L - 8], k[:, :, :L - 8], v[:, :, :L - 8])
    before = [c.num_slots for c in layer.codes]
    layer.update(k[:, :, L - 8:], v[:, :, L - 8:])  # an extend of 8 tokens: one flush of 2 groups
    ctx = Context(layer_idx=0, layer=layer, phase="extend", query=q[:, :, L - 8:], scaling=D ** -0.5)
    policy.on_extend(ctx)
    high, low = layer.codes
    assert [high.num_slots - before[0], low.num_slots - before[1]] == [4, 4]
    x = torch.einsum("bhrd,bhtd->bhrt", q[:, :, L - 8:], k.repeat_interleave(G, 1)) / math.sqrt(D)
    x = x.masked_fill(torch.arange(L)[None] > torch.arange(L - 8, L)[:, None], -math.inf)
    attention = x.softmax(-1).sum(2).view(B, HKV, G, L).sum(2)[..., L - 8:]
    for b in range(B):
        for h in range(HKV):
            expect = sorted((attention[b, h].argsort()[:4] + L - 8).tolist())
            assert low.positions[b, h, -4:].tolist() == expect


def test_low_ratio_zero_and_one_are_kivi_at_one_width():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    for low_ratio, bits in ((0.0, 4), (1.0, 2)):
        outs = []
        for policy, kw in (("kivi", dict(bits=bits, group_size=16, residual_length=16)),
                           ("zipcache", dict(low_ratio=low_ratio, group_size=16, residual_length=16))):
            patch = kvpress.patch_model(model, policy=policy, **kw)
            try:
                cache = kvpress.KVPressCache()
                outs.append((greedy(model, ids, 40, cache=cache),
                             sum(layer.kv_nbytes() for layer in cache.layers)))
            finally:
                patch.unpatch()
        assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


@pytest.mark.parametrize("policy, kw", [("snapkv+zipcache", dict(window_size=8)),
                                        ("kvzip+zipcache", dict(chunk_size=16))])  # kvzip: after the whole prompt
def test_composes_after_an_evictor(policy, kw):
    """The prompt's saliency is measured before the eviction; the kept slots are split by it."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    if policy.startswith("kvzip"):
        kw["tokenizer"] = TOK
    patch = kvpress.patch_model(model, policy=policy, compression_ratio=0.5, group_size=16, **kw)
    try:
        cache = kvpress.KVPressCache()
        greedy(model, ids, 8, cache=cache)
        for layer in cache.layers:
            counts = [int(c.counts().sum()) for c in layer.codes]
            # kept + generated
            assert len(counts) == 2 and counts[1] > 0 and sum(counts) <= (45 + 8) * layer.num_kv_heads
            assert "zipcache saliency" not in layer.policy_stats  # dropped after the prompt's flush
    finally:
        patch.unpatch()


@pytest.mark.parametrize("kw, match", [
    (dict(high_bits=3), "high_bits=3; allowed values: \\[2, 4, 8\\]"),
    (dict(low_bits=8), "low_bits=8 > high_bits=4"),
    (dict(low_ratio=1.5), "low_ratio=1.5; allowed values: a number in \\[0, 1\\]"),
    (dict(recent_ratio=0), "recent_ratio=0.0; allowed values: a number in \\(0, 1\\]"),
    (dict(group_size=0), "group_size=0; allowed values: an int >= 1"),
])
def test_bad_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        ZipCache(**kw).validate()
