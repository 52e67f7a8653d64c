"""Low-bit storage (KIVI, GEAR): packing, codec error bounds, kernels vs dense attention, bytes, composition."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.integrations.hf import given_cache
from kvpress.cache.codecs import encode_gear, encode_kivi
from kvpress.formats.lowbit import pack, unpack, unpack_floats
from kvpress.kernels import allowed_mask
from kvpress.kernels.online_softmax import Queries, dense_attention_state, finish
from kvpress.kernels.quant_attention import (codes_domain_attention_state, lowbit_attention_state,
                                             lowbit_attention_state_reference)
from kvpress.kernels.triton_quant import available as triton_available
from kvpress.kernels.triton_quant import lowbit_attention_state_triton
from kvpress.policies import H2O, KIVI

from conftest import greedy, tiny_model


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_is_exact(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8  # really packed
    assert torch.equal(unpack(packed, bits), codes)
    assert torch.equal(unpack_floats(packed, bits), codes.float())


def manual_dequant(seg, k_shape):
    """Independent dequantization: unpack bits by hand, apply per-group scale/min by loops over groups."""
    B, H, T, D = k_shape
    per = 8 // seg.bits

    def codes(packed):
        out = torch.zeros(B, H, T, D)
        for c in range(D):
            out[..., c] = ((packed[..., c // per].int() >> ((c % per) * seg.bits)) & (2 ** seg.bits - 1)).float()
        return out

    kc, vc = codes(seg.k_codes), codes(seg.v_codes)
    k, v = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
    G = seg.group_size
    for t in range(T):
        k[:, :, t] = kc[:, :, t] * seg.k_scale[:, :, t // G].float() + seg.k_min[:, :, t // G].float()
        for grp in range(D // G):
            sl = slice(grp * G, (grp + 1) * G)
            v[:, :, t, sl] = vc[:, :, t, sl] * seg.v_scale[:, :, t, grp, None].float() + seg.v_min[:, :, t, grp, None].float()
    return k, v


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_round_trip_error_is_within_half_a_step(bits):
    torch.manual_seed(0)
    B, H, T, D, G = 2, 2, 64, 32, 16
    k, v = torch.randn(B, H, T, D) * 3, torch.randn(B, H, T, D)
    k[..., 5] += 20  # an outlier channel: per-channel key groups absorb it
    seg = encode_kivi(k, v, torch.ones(B, H, T, dtype=torch.bool), bits, G)
    kd, vd = manual_dequant(seg, k.shape)
    torch.testing.assert_close(seg.dequantize(0, T)[0], kd)  # library dequant == independent dequant
    torch.testing.assert_close(seg.dequantize(0, T)[1], vd)
    levels = 2 ** bits - 1
    k_step = (k.reshape(B, H, T // G, G, D).amax(3) - k.reshape(B, H, T // G, G, D).amin(3)) / levels
    v_step = (v.reshape(B, H, T, D // G, G).amax(4) - v.reshape(B, H, T, D // G, G).amin(4)) / levels
    k_bound = k_step.repeat_interleave(G, 2) / 2 + 1e-2 * k.abs() + 1e-3  # + fp16 scale/min rounding
    v_bound = v_step.repeat_interleave(G, 3) / 2 + 1e-2 * v.abs() + 1e-3
    assert ((kd - k).abs() <= k_bound).all() and ((vd - v).abs() <= v_bound).all()


def _errors(k, v, **gear):
    valid = torch.ones(k.shape[:3], dtype=torch.bool)
    kivi = encode_kivi(k, v, valid, 2, 32).dequantize(0, k.shape[2])
    gear_ = encode_gear(k, v, valid, 2, 32, **gear).dequantize(0, k.shape[2])
    return [((a - x).norm().item(), (b - x).norm().item()) for x, a, b in ((k, kivi[0], gear_[0]), (v, kivi[1], gear_[1]))]


def test_gear_error_is_below_kivi_at_the_same_bits():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 128, 64) + torch.randn(1, 2, 1, 64) * 4
    v = torch.randn(1, 2, 128, 64)
    for kivi_err, gear_err in _errors(k, v, rank=4, outlier_ratio=0.02, power_iters=3):
        assert gear_err < kivi_err  # never worse, even where there is no structure to exploit
    # sparse large entries (what GEAR's outlier term is for) inflate every group's range under KIVI alone
    spikes = (torch.rand(1, 2, 128, 64) < 0.01) * torch.randn(1, 2, 128, 64) * 30
    for kivi_err, gear_err in _errors(k + spikes, v + spikes, rank=4, outlier_ratio=0.04, power_iters=3):
        assert gear_err < 0.9 * kivi_err


def test_gear_encodes_a_shorter_row_behind_fillers_as_it_encodes_it_alone():
    """A flat flush encodes rows of different lengths as one rectangle, the shorter ones ending in fillers: the
    outlier counts (per channel, from the row's own slots), outlier picks (never a filler) and low-rank start
    must not depend on the other rows, so the short row decodes exactly as when encoded alone."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 64, 64, generator=g) + (torch.rand(2, 2, 64, 64, generator=g) < 0.02) * 25
    v = torch.randn(2, 2, 64, 64, generator=g)
    k[1] -= 3  # all-negative channels: a filler (0) must not become the "largest" outlier
    valid = torch.ones(2, 2, 64, dtype=torch.bool)
    valid[1, :, 32:] = False  # row 1 has 32 real slots (2 groups), then fillers
    params = dict(bits=2, group_size=16, rank=2, outlier_ratio=0.25, power_iters=2)
    batched = encode_gear(k, v, valid, **params)
    alone = encode_gear(k[1:, :, :32], v[1:, :, :32], valid[1:, :, :32], **params)
    for got, want in zip(batched.dequantize(0, 64), alone.dequantize(0, 32)):
        torch.testing.assert_close(got[1:, :, :32], want, atol=2e-3, rtol=1e-3)


def dense_reference(q, seg, rk, rv, pos, valid, qpos, window=None):
    """Plain attention over the dequantized cache (independent of the block-wise online softmax)."""
    g = q.shape[1] // rk.shape[1]
    kd, vd = seg.dequantize(0, seg.num_slots)
    K, V = torch.cat([kd, rk.float()], 2), torch.cat([vd, rv.float()], 2)
    allowed = allowed_mask(qpos, pos, valid, window).repeat_interleave(g, 1)
    logits = (q.float() @ K.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ V.repeat_interleave(g, 1)


def lowbit_then_residual(lowbit_state, q, rk, rv, pos, valid, qpos, window=None):
    """A layer's read: the low-bit slots' state (the kernel under test), then the full-precision residual."""
    queries = Queries(q, qpos, q.shape[-1] ** -0.5, sliding_window=window)
    n_q = pos.shape[-1] - rk.shape[2]
    state = dense_attention_state(queries, rk, rv, pos[..., n_q:], valid[..., n_q:], lowbit_state(queries))
    return finish(state, queries)


def random_case(seed, B, HKV, G_QA, R_Q, TQ, TR, D=32, group=16, bits=2, gathered=False, window=None):
    torch.manual_seed(seed)
    k, v = torch.randn(B, HKV, TQ, D), torch.randn(B, HKV, TQ, D)
    valid = torch.ones(B, HKV, TQ + TR, dtype=torch.bool)
    valid[-1, :, :3] = False  # a left-padded row
    seg = encode_kivi(k, v, valid[..., :TQ], bits, group)
    pos = torch.arange(TQ + TR).expand(B, HKV, -1)
    if gathered:  # an eviction policy dropped slots: ragged per head, explicit key-group ids
        keep = torch.stack([torch.randperm(TQ)[: TQ - 5].sort().values for _ in range(B * HKV)]).view(B, HKV, -1)
        seg = seg.gather(keep)
        pos = torch.cat([pos[..., :TQ].gather(-1, keep), pos[..., TQ:]], -1)
        valid = torch.cat([valid[..., :TQ].gather(-1, keep), valid[..., TQ:]], -1)
    rk, rv = torch.randn(B, HKV, TR, D), torch.randn(B, HKV, TR, D)
    qpos = torch.arange(TQ + TR - R_Q, TQ + TR)
    q = torch.randn(B, HKV * G_QA, R_Q, D)
    return q, seg, rk, rv, pos, valid, qpos, window


CASES = [  # (B, Hkv, GQA group, q_len, quantized slots, residual slots, bits, gathered, window)
    (1, 1, 1, 1, 32, 0, 2, False, None),
    (2, 2, 4, 1, 64, 7, 2, False, None),
    (1, 2, 3, 3, 48, 20, 4, False, None),
    (2, 1, 2, 2, 80, 33, 2, True, None),
    (1, 2, 2, 1, 96, 10, 8, True, 40),
    (1, 2, 2, 2, 64, 5, 8, False, None),
    (1, 2, 4, 20, 64, 5, 4, False, None),  # 20 rows x 4: the Triton kernel runs them in blocks of rows_per_call(4)
    (1, 1, 4, 18, 64, 3, 2, True, None),
]


@pytest.mark.parametrize("case", CASES)
def test_low_bit_attention_equals_attention_over_dequantized_cache(case):
    B, HKV, GQ, RQ, TQ, TR, bits, gathered, window = case
    q, seg, rk, rv, pos, valid, qpos, window = random_case(0, B, HKV, GQ, RQ, TQ, TR, bits=bits, gathered=gathered,
                                                           window=window)
    expected = dense_reference(q, seg, rk, rv, pos, valid, qpos, window)
    ref = lowbit_then_residual(lambda queries: lowbit_attention_state_reference(
        queries, seg, pos[..., :seg.num_slots], valid[..., :seg.num_slots], block=24), q, rk, rv, pos, valid, qpos, window)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    # the CPU path the dispatcher picks (codes domain for slot-ordered KIVI codes, the reference otherwise)
    picked = lowbit_then_residual(lambda queries: lowbit_attention_state(
        queries, seg, pos[..., :seg.num_slots], valid[..., :seg.num_slots], use_triton=False), q, rk, rv, pos, valid,
        qpos, window)
    torch.testing.assert_close(picked, expected, atol=1e-5, rtol=1e-5)
    if not gathered:
        for block in (4096, 40):  # one block; blocks of whole key groups (40 -> 32 slots)
            codes_domain = lowbit_then_residual(lambda queries: codes_domain_attention_state(
                queries, seg, pos[..., :seg.num_slots], valid[..., :seg.num_slots], block=block), q, rk, rv, pos,
                valid, qpos, window)
            torch.testing.assert_close(codes_domain, expected, atol=1e-5, rtol=1e-5)
    assert triton_available(), "Triton must run here (CUDA, or TRITON_INTERPRET=1 on CPU)"
    for block_t in (16, 64):  # blocks inside one key group (its scale folded into the query), or across groups
        tri = lowbit_then_residual(lambda queries: lowbit_attention_state_triton(
            queries, seg, pos[..., :seg.num_slots], valid[..., :seg.num_slots], block_t=block_t, target_programs=4),
            q, rk, rv, pos, valid, qpos, window)
        torch.testing.assert_close(tri, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if not c[7]])
def test_cpu_kernel_equals_attention_over_dequantized_cache(case):
    """lowbit_cpu.c (built here: CI has a C compiler), with and without the full-precision tail in the same call,
    with a mask (padding, several query rows) and, for a decode step over real slots only, without one."""
    from kvpress.kernels import lowbit_native

    assert lowbit_native.available()
    B, HKV, GQ, RQ, TQ, TR, bits, gathered, window = case
    for decode in (False, True):
        q, seg, rk, rv, pos, valid, qpos, window = random_case(0, B, HKV, GQ, 1 if decode else RQ, TQ, TR, bits=bits,
                                                               window=window)
        if decode:
            valid = torch.ones_like(valid)  # no padding: every slot is real, the kernel builds no mask
        expected = dense_reference(q, seg, rk, rv, pos, valid, qpos, window)
        queries = Queries(q, qpos, q.shape[-1] ** -0.5, sliding_window=window)
        seg_valid = None if decode else valid[..., :TQ]
        assert lowbit_native.supports(queries, seg)
        tail_valid = None if decode else valid[..., TQ:]
        together = lowbit_native.lowbit_attention_state_native(queries, seg, pos[..., :TQ], seg_valid,
                                                               tail=(rk, rv, pos[..., TQ:], tail_valid))
        torch.testing.assert_close(finish(together, queries), expected, atol=1e-5, rtol=1e-5)
        # the tail as the filled prefix of buffers with spare room (a layer's tail): read in place, same result
        room_k, room_v = (torch.randn(B, HKV, TR + 7, t.shape[-1]) for t in (rk, rv))
        room_k[:, :, :TR], room_v[:, :, :TR] = rk, rv
        in_place = lowbit_native.lowbit_attention_state_native(
            queries, seg, pos[..., :TQ], seg_valid, tail=(room_k[:, :, :TR], room_v[:, :, :TR], pos[..., TQ:],
                                                          tail_valid))
        assert TR == 0 or lowbit_native._rows_in_place(room_k[:, :, :TR]).data_ptr() == room_k.data_ptr()  # no copy
        torch.testing.assert_close(finish(in_place, queries), expected, atol=1e-5, rtol=1e-5)
        alone = lowbit_then_residual(lambda queries: lowbit_native.lowbit_attention_state_native(
            queries, seg, pos[..., :TQ], seg_valid), q, rk, rv, pos, valid, qpos, window)
        torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-5)


def _attention_over(codes, positions, valid, q, qpos):
    """[B, Hq, r, D]: attention of q (rows at positions qpos) over the dequantized slots of rectangular codes
    where valid, causal by the slots' positions [B, Hkv, T]."""
    keys, values = codes.dequantize(0, codes.num_slots)
    group = q.shape[1] // keys.shape[1]
    allowed = valid[:, :, None] & (positions[:, :, None] <= qpos[:, None])
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
        attn_mask=allowed.repeat_interleave(group, 1), scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("codec", ["kivi", "gear"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("D", [32, 64])
def test_cpu_kernel_reads_flat_runs_and_gathered_codes(codec, rows, D):
    """lowbit_cpu.c over flat codes (a left-padded batch whose padding cuts key groups: per-(row, head) runs of
    one store, each starting with a partial key group) and over codes gathered by an eviction (explicit key
    groups) equals attention over the dequantized tokens, as the torch reference does; one query row reads with
    no mask, several with one. head_dim 32 reads through the generic split, 64 through the vectorised one."""
    from kvpress.kernels import lowbit_native
    from kvpress.kernels.quant_attention import flat_lowbit_attention_state_reference

    torch.manual_seed(7)
    B, HKV, G, T, group = 2, 2, 3, 64, 16
    k, v = torch.randn(B, HKV, T, D) + 2 * torch.randn(D), torch.randn(B, HKV, T, D)
    valid = (torch.arange(T) >= torch.tensor([5, 21])[:, None, None]).expand(B, HKV, T).contiguous()
    if codec == "kivi":
        codes = encode_kivi(k, v, valid, 4, group)
    else:
        codes = encode_gear(k, v, valid, 4, group, rank=2, outlier_ratio=0.1, power_iters=3)
    q, qpos = torch.randn(B, HKV * G, rows, D), torch.arange(T - rows, T)
    queries = Queries(q, qpos, D ** -0.5)
    slot_positions = torch.arange(T).expand(B, HKV, T)
    expected = _attention_over(codes, slot_positions, valid, q, qpos)

    flat, lengths = codes.flatten(valid), valid.sum(-1)
    flat_positions = slot_positions[valid][None, None]
    assert lowbit_native.supports(queries, flat) and flat.k_group is not None
    native = lowbit_native.flat_lowbit_attention_state_native(queries, flat, flat_positions, lengths)
    torch.testing.assert_close(finish(native, queries), expected, atol=1e-5, rtol=1e-5)
    reference = flat_lowbit_attention_state_reference(queries, flat, flat_positions, lengths, block=24)
    torch.testing.assert_close(finish(reference, queries), expected, atol=1e-5, rtol=1e-5)

    # a store grown by two flushes (each run's slots of the first, then of the second): GEAR's chunks and key
    # outliers then come in flush order, not run by run
    from kvpress.cache.segments import Segment

    encode = encode_kivi if codec == "kivi" else (
        lambda *args: encode_gear(*args, rank=2, outlier_ratio=0.1, power_iters=3))
    parts = [encode(k[..., lo:hi, :], v[..., lo:hi, :], valid[..., lo:hi], 4, group) for lo, hi in ((0, 48), (48, T))]
    halves = [Segment(part.flatten(valid[..., lo:hi]), slot_positions[..., lo:hi][valid[..., lo:hi]][None, None],
                      lengths=valid[..., lo:hi].sum(-1)) for part, (lo, hi) in zip(parts, ((0, 48), (48, T)))]
    grown = halves[0].cat_runs(halves[1])
    if codec == "gear":
        assert grown.data.k_basis.shape[2] == 2 * B * HKV
    keys, values = (torch.cat(pair, 2) for pair in zip(*(part.dequantize(0, part.num_slots) for part in parts)))
    allowed = (valid[:, :, None] & (slot_positions[:, :, None] <= qpos[:, None])).repeat_interleave(G, 1)
    two_flushes = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1), attn_mask=allowed, scale=D ** -0.5)
    native = lowbit_native.flat_lowbit_attention_state_native(queries, grown.data, grown.positions, grown.lengths)
    torch.testing.assert_close(finish(native, queries), two_flushes, atol=1e-5, rtol=1e-5)

    # an eviction kept 30 slots per head (sorted, from the real ones), some of them fillers
    keep = torch.stack([torch.randperm(T - 21)[:30].sort().values + 21 for _ in range(B * HKV)]).view(B, HKV, 30)
    real = (torch.rand(B, HKV, 30) > 0.2) | (keep >= T - rows)  # a query's own token is never a filler
    gathered, positions = codes.gather(keep, real), keep
    assert gathered.k_group is not None and lowbit_native.supports(queries, gathered)
    native = lowbit_native.lowbit_attention_state_native(queries, gathered, positions, real)
    torch.testing.assert_close(finish(native, queries), _attention_over(gathered, positions, real, q, qpos),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("codec", ["kivi", "gear"])
@pytest.mark.parametrize("dim, bits, group", [(64, 2, 32), (64, 4, 32), (128, 2, 32), (128, 4, 32), (64, 8, 32),
                                              (64, 4, 16), (64, 2, 8), (128, 4, 64)])
def test_cpu_kernel_specialised_head_dims(codec, dim, bits, group):
    """lowbit_cpu.c reads codes of head_dim 64/128 at 2/4 bits with value groups of a multiple of 16 channels
    through a hand-vectorised split (vector_rows, query rows in blocks of 4), other shapes (8 bits, value groups
    of 8) through the generic one: each equals attention over the dequantized tokens, for a padded batch with
    several query rows (a mask; 6 rows: a block of 4 and one of 2), for one decode row over real slots (no mask),
    and over codes gathered by an eviction (key groups per slot)."""
    from kvpress.kernels import lowbit_native

    torch.manual_seed(dim + bits + group)
    B, HKV, G, T = 2, 2, 3, 192
    k, v = torch.randn(B, HKV, T, dim) + torch.randn(dim), torch.randn(B, HKV, T, dim)
    for rows, pad, gathered in ((3, 7, False), (1, 0, False), (6, 7, False), (2, 7, True)):
        valid = (torch.arange(T) >= torch.tensor([0, pad])[:, None, None]).expand(B, HKV, T).contiguous()
        codes = encode_kivi(k, v, valid, bits, group) if codec == "kivi" else encode_gear(
            k, v, valid, bits, group, rank=2, outlier_ratio=0.05, power_iters=2)
        q, qpos = torch.randn(B, HKV * G, rows, dim), torch.arange(T - rows, T)
        queries = Queries(q, qpos, dim ** -0.5)
        positions = torch.arange(T, dtype=torch.int32).expand(B, HKV, T)
        if gathered:
            keep = torch.stack([torch.cat([torch.randperm(T - rows)[:48].sort().values, torch.arange(T - rows, T)])
                                for _ in range(B * HKV)]).view(B, HKV, -1)  # the queries' own tokens stay
            codes, positions, valid = codes.gather(keep), keep.to(torch.int32), valid.gather(-1, keep)
        assert lowbit_native.supports(queries, codes)
        native = lowbit_native.lowbit_attention_state_native(queries, codes, positions, valid if pad else None)
        torch.testing.assert_close(finish(native, queries), _attention_over(codes, positions, valid, q, qpos),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank", [1, 3, 4, 5])
def test_cpu_kernel_gear_ranks(rank):
    """GEAR's low-rank term in the vectorised split (ranks up to 4, held as one 4-lane vector with zeros beyond
    the rank) and through the generic split (rank 5) equals attention over the dequantized tokens."""
    from kvpress.kernels import lowbit_native

    torch.manual_seed(rank)
    B, HKV, G, T, D = 2, 2, 3, 128, 64
    k, v = torch.randn(B, HKV, T, D) + torch.randn(D), torch.randn(B, HKV, T, D)
    valid = (torch.arange(T) >= torch.tensor([0, 5])[:, None, None]).expand(B, HKV, T).contiguous()
    codes = encode_gear(k, v, valid, 4, 32, rank=rank, outlier_ratio=0.05, power_iters=2)
    q, qpos = torch.randn(B, HKV * G, 2, D), torch.arange(T - 2, T)
    queries = Queries(q, qpos, D ** -0.5)
    positions = torch.arange(T, dtype=torch.int32).expand(B, HKV, T)
    assert lowbit_native.supports(queries, codes)
    native = lowbit_native.lowbit_attention_state_native(queries, codes, positions, valid)
    torch.testing.assert_close(finish(native, queries), _attention_over(codes, positions, valid, q, qpos),
                               atol=1e-5, rtol=1e-5)


def test_cpu_kernel_without_a_compiler_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path):
    from kvpress.kernels import lowbit_native

    monkeypatch.setattr(lowbit_native._native, "_library", False)  # not tried yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no library built earlier
    q, seg, rk, rv, pos, valid, qpos, window = random_case(0, 2, 2, 4, 1, 64, 7)
    with pytest.warns(UserWarning, match="could not be built"):
        assert not lowbit_native.available()
    got = lowbit_then_residual(lambda queries: lowbit_attention_state(
        queries, seg, pos[..., :64], valid[..., :64], use_triton=False), q, rk, rv, pos, valid, qpos)
    torch.testing.assert_close(got, dense_reference(q, seg, rk, rv, pos, valid, qpos), atol=1e-5, rtol=1e-5)


def test_gear_attention_reference_equals_dense():
    q, seg, rk, rv, pos, valid, qpos, _ = random_case(1, 1, 2, 2, 1, 32, 5)
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 32, 32), torch.randn(1, 2, 32, 32)
    seg = encode_gear(k, v, valid[..., :32], 2, 16, rank=2, outlier_ratio=0.25, power_iters=3)
    assert seg.k_out_slot.shape[-1] == 2 * 4 * 32 and seg.v_out_idx.shape[-1] == 2 * 4
    expected = dense_reference(q, seg, rk, rv, pos, valid, qpos)
    torch.testing.assert_close(
        lowbit_then_residual(lambda queries: lowbit_attention_state_reference(
            queries, seg, pos[..., :32], valid[..., :32], block=8), q, rk, rv, pos, valid, qpos),
        expected, atol=1e-5, rtol=1e-5)
    # the CPU path: GEAR's low-rank term and both kinds of outliers as corrections to the codes' contraction,
    # one encoded chunk (one basis) and two
    two = encode_gear(k[:, :, :16], v[:, :, :16], valid[..., :16], 2, 16, rank=2, outlier_ratio=0.25,
                      power_iters=3).cat(encode_gear(k[:, :, 16:], v[:, :, 16:], valid[..., 16:32], 2, 16, rank=2,
                                                        outlier_ratio=0.25, power_iters=3))
    assert two.k_basis.shape[2] == 2 and two.chunk.unique().tolist() == [0, 1]
    from kvpress.kernels import lowbit_native

    for codes, dense in ((seg, expected), (two, dense_reference(q, two, rk, rv, pos, valid, qpos))):
        torch.testing.assert_close(
            lowbit_then_residual(lambda queries: codes_domain_attention_state(
                queries, codes, pos[..., :32], valid[..., :32]), q, rk, rv, pos, valid, qpos),
            dense, atol=1e-5, rtol=1e-5)
        # and the C kernel (GEAR's terms in the same pass), which the dispatcher picks on CPU
        assert lowbit_native.supports(Queries(q, qpos, 1.0), codes)
        torch.testing.assert_close(
            lowbit_then_residual(lambda queries: lowbit_native.lowbit_attention_state_native(
                queries, codes, pos[..., :32], valid[..., :32]), q, rk, rv, pos, valid, qpos),
            dense, atol=1e-5, rtol=1e-5)


def test_gear_outliers_follow_their_tokens_through_eviction():
    torch.manual_seed(4)
    k, v = torch.randn(1, 2, 32, 16) * 2, torch.randn(1, 2, 32, 16)
    seg = encode_gear(k, v, torch.ones(1, 2, 32, dtype=torch.bool), 2, 16, rank=2, outlier_ratio=0.25, power_iters=3)
    before = seg.dequantize(0, 32)
    keep = torch.tensor([[[0, 3, 4, 9, 20, 31, 0], [1, 2, 5, 8, 16, 30, 0]]])  # last column: a filler
    real = torch.tensor([True] * 6 + [False]).expand(1, 2, 7)
    after = seg.gather(keep, real).dequantize(0, 7)
    for b, a in zip(before, after):
        torch.testing.assert_close(a[..., :6, :], b.gather(2, keep[..., :6, None].expand(-1, -1, -1, 16)))
    # every surviving key outlier entry points at its token's new slot and reproduces the original value
    kept = seg.gather(keep, real)
    k_exact = k.gather(2, keep[..., :6, None].expand(-1, -1, -1, 16))
    live = kept.k_out_slot >= 0
    assert live.sum() > 0 and (kept.k_out_slot[live] < 6).all()
    for h in range(2):
        slots, chans = kept.k_out_slot[0, h][live[0, h]].long(), kept.k_out_chan[0, h][live[0, h]].long()
        torch.testing.assert_close(after[0][0, h, slots, chans], k_exact[0, h, slots, chans], atol=1e-2, rtol=1e-3)


def _kivi_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, KVPressLayer)]


def test_nbytes_is_the_real_storage_and_residual_stays_bounded():
    """300 generated tokens with KIVI(residual 32, group 16): after every forward the full-precision part holds
    at most residual + group - 1 tokens, and nbytes() equals the bytes of the tensors the layer holds."""
    model = tiny_model("llama")
    record = []

    def after(module, args, kwargs, output):
        for layer in _kivi_layers(given_cache(kwargs)):
            held = [t for segment in layer.segments for t in segment.tensors()]
            record.append((layer.view_width - layer.quantized_len, layer.nbytes(),
                           sum(t.untyped_storage().nbytes() for t in held), layer.quantized_len))

    with kvpress.patch_model(model, KIVI(bits=2, group_size=16, residual_length=32)):
        handle = model.register_forward_hook(after, with_kwargs=True)
        greedy(model, torch.randint(3, 128, (1, 40)), 300)
        handle.remove()
    assert max(r[0] for r in record) <= 32 + 16 - 1 and min(r[0] for r in record[2:]) >= 32
    assert all(nbytes == real for _, nbytes, real, _ in record)  # no hidden views onto bigger buffers
    assert record[-1][3] == ((340 - 1 - 32) // 16) * 16  # everything older than the residual is low-bit


def test_kv_bytes_of_kivi2_match_the_theory():
    """KIVI-2, group 32, residual 128, fp16 K/V, 8K tokens: codes + scales + residual, nothing else."""
    B, H, T, D, G, R = 1, 2, 8192, 64, 32, 128
    layer = KVPressLayer()
    layer.update(torch.randn(B, H, T, D, dtype=torch.float16), torch.randn(B, H, T, D, dtype=torch.float16))
    full = layer.kv_nbytes()
    KIVI(bits=2, group_size=G, residual_length=R).store(layer, 0)
    n_q = ((T - R) // G) * G
    theory = 2 * n_q * D * 2 // 8 + 2 * (n_q // G) * D * 2 + 2 * n_q * (D // G) * 2 + (T - n_q) * D * 2 * 2
    assert abs(layer.kv_nbytes() - theory * H) <= 0.05 * theory * H
    assert layer.kv_nbytes() <= 0.22 * full


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_over_evicted_and_quantized_cache_equals_dense_reference(arch):
    """snapkv+kivi: the stock model reading a plain cache with the dequantized kept tokens gives the same logits."""
    model = tiny_model(arch)
    torch.manual_seed(3)
    ids, nxt = torch.randint(3, 128, (1, 90)), torch.tensor([[5]])
    with kvpress.patch_model(model, "snapkv+kivi", budget=60, window_size=4, bits=4, group_size=16,
                             residual_length=16):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
        snapshot = []
        for layer in cache.layers:
            assert layer.quantized_len == 32 and layer.view_width == 60
            kd, vd = layer.codes[0].data.dequantize(0, layer.quantized_len)
            snapshot.append((torch.cat([kd, layer.tail.data.keys], 2), torch.cat([vd, layer.tail.data.values], 2)))
        logits = model(nxt, cache=cache).logits
    dense = DynamicCache()
    for i, (k, v) in enumerate(snapshot):
        dense.update(k, v, i)
    ref = model(nxt, cache=dense, position_ids=torch.tensor([[90]])).logits
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_decode_time_eviction_over_a_quantized_cache_holds_the_budget():
    model = tiny_model("llama")
    with kvpress.patch_model(model, [H2O(budget=48, recent=8), KIVI(bits=2, group_size=16, residual_length=16)]):
        cache = KVPressCache(model.config)
        greedy(model, torch.randint(3, 128, (1, 64)), 100, cache=cache)
    for layer in cache.layers:
        assert (layer.tokens_per_head() == 48).all() and layer.quantized_len > 0
        assert layer.view_width <= 48 + 16  # per-head fillers stay bounded


# ---------------------------------------------------------------------------- real model
def test_smollm2_kivi4_matches_full_cache_on_16_tokens(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Explain in a few sentences why the sky is blue, "
                                    "and why sunsets are red."}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    assert ids.shape[1] >= 48  # so that most of the prompt is stored low-bit
    ref = greedy(model, ids, 16)
    with kvpress.patch_model(model, "kivi", bits=4, group_size=16, residual_length=16):  # most of the prompt low-bit
        out = greedy(model, ids, 16)
    assert out.tolist() == ref.tolist()


def test_smollm2_snapkv_kivi_batch_of_two_left_padded(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    texts = ["Tell me a fact about owls. " * 12, "Name a colour."]
    batch = tok(texts, return_tensors="pt", padding=True)
    with kvpress.patch_model(model, "snapkv+kivi", compression_ratio=0.5, bits=2, group_size=16, residual_length=16):
        cache = KVPressCache(model.config)
        out = model.generate(**batch, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 2
    layer = cache.layers[0]
    assert layer.quantized_len > 0 and layer.key_valid_or_none() is not None
    kept = layer.tokens_per_head()
    n_real = batch.attention_mask.sum(1)
    assert kept[:, 0].tolist() == [int(n - (n + 1) // 2) + 5 for n in n_real]  # N - ceil(N / 2) kept, + 5 new


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="kivi", bits=3), r"kivi: bits=3; allowed values: \[2, 4, 8\]"),
    (dict(policy="kivi", group_size=32), r"group_size=32 does not divide the model's head_dim=16"),
    (dict(policy="kivi+gear"), r"two storage codecs"),
    (dict(policy=["snapkv", "h2o", "kivi"], compression_ratio=0.5), r"two eviction policies"),
    (dict(policy="snapkv+kivii"), r"policy='kivii' is unknown"),
    (dict(policy="gear", rank=0), r"gear: rank=0; allowed values"),
    (dict(policy="streaming_llm+kivi", budget=64, cache_local_positions=True), r"cannot combine with the codec"),
])
def test_bad_codec_arguments_leave_model_untouched(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, **kwargs)
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__
