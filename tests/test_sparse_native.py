"""The CPU sparse-read kernel (kernels/sparse_cpu.c) against attention written out densely: the chosen slots of
each head as a mask over every stored slot, one masked softmax in torch."""

import pytest
import torch

from kvpress.kernels import sparse_native
from kvpress.kernels.online_softmax import Queries, finish
from kvpress.kernels.scores import allowed_mask
from kvpress.kernels.sparse_attention import Selection, sparse_attention_state, sparse_attention_state_reference


def _dense(q, keys, values, positions, qpos, chosen, group, scale, window, softcap):
    """Masked softmax over every slot, the unchosen ones masked out (independent of any kernel)."""
    allowed = (allowed_mask(qpos, positions, chosen, window) & chosen[:, :, None]).repeat_interleave(group, 1)
    logits = q.float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs @ values.float().repeat_interleave(group, 1)


@pytest.mark.parametrize("dtype, window, softcap, rows, width", [
    (torch.float32, None, None, 1, 600), (torch.bfloat16, None, None, 1, 700), (torch.float16, 20, None, 3, 90),
    (torch.float32, None, 30.0, 2, 1200), (torch.bfloat16, 50, 30.0, 6, 300)])
def test_native_sparse_read_equals_dense_masked_attention(dtype, window, softcap, rows, width):
    """Keys/values a slice of a larger buffer (read in place through strides), ragged selections with padding,
    several splits per head (width > 256), GQA groups, causal rows, a window and a softcap."""
    torch.manual_seed(rows + width)
    B, HKV, G, D, T = 2, 3, 2, 32, 1500
    buffer_k, buffer_v = torch.randn(B, HKV, T + 40, D).to(dtype), torch.randn(B, HKV, T + 40, D).to(dtype)
    keys, values = buffer_k[:, :, :T], buffer_v[:, :, :T]
    positions = (torch.arange(T) * 2).expand(B, HKV, T).to(torch.int32)  # original positions: not the slots
    idx = torch.stack([torch.randperm(T)[:width] for _ in range(B * HKV)]).view(B, HKV, width)
    ok = torch.rand(B, HKV, width) > 0.2
    ok[0, 1] = False  # a head with nothing to read keeps an empty state
    q = torch.randn(B, HKV * G, rows, D)
    qpos = torch.arange(2 * T - rows, 2 * T) - 100  # some selected slots are after the first rows: masked
    queries = Queries(q, qpos, D ** -0.5, softcap, window)
    assert sparse_native.supports(queries, keys, values)
    state = sparse_native.sparse_attention_state_native(queries, keys, values, positions, idx, ok)
    chosen = torch.zeros(B, HKV, T, dtype=torch.bool).scatter(-1, idx, ok)
    expected = _dense(q, keys, values, positions, qpos, chosen, G, D ** -0.5, window, softcap)
    m, l, acc = state
    empty = l == 0
    assert bool(empty[0, 1].all())
    out = finish(state, queries)
    readable = ~empty.reshape(B, HKV * G, rows)
    torch.testing.assert_close(out.float()[readable], expected[readable], atol=2e-5, rtol=2e-5)
    ref = sparse_attention_state_reference(queries, keys, values, positions, Selection(idx, ok))
    torch.testing.assert_close(m, ref[0])
    torch.testing.assert_close(l, ref[1], atol=1e-5, rtol=1e-5)


def test_native_sparse_read_of_a_flat_store_and_the_dispatch():
    """A flat store [N, D] shared by every (row, head): indices are slots of it; sparse_attention_state picks the
    kernel on CPU and gives the reference's result."""
    torch.manual_seed(3)
    N, D, B, HKV, G, K = 400, 16, 1, 2, 3, 50
    keys, values, positions = torch.randn(N, D), torch.randn(N, D), torch.arange(N, dtype=torch.int32)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B * HKV)]).view(B, HKV, K)
    queries = Queries(torch.randn(B, HKV * G, 1, D), torch.tensor([N]), 0.25)
    selection = Selection(idx)
    assert sparse_native.supports(queries, keys, values)
    got = finish(sparse_attention_state(queries, keys, values, positions, selection), queries)
    ref = finish(sparse_attention_state_reference(queries, keys, values, positions, selection), queries)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    chosen = torch.zeros(B, HKV, N, dtype=torch.bool).scatter(-1, idx, True)
    dense = _dense(queries.values, keys.expand(B, HKV, N, D), values.expand(B, HKV, N, D),
                   positions.expand(B, HKV, N), queries.positions, chosen, G, 0.25, None, None)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


def test_without_a_compiler_sparse_reads_fall_back_to_torch_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(sparse_native._native, "_library", False)  # not tried yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no library built earlier
    keys = torch.randn(1, 1, 10, 8)
    queries = Queries(torch.randn(1, 1, 1, 8), torch.tensor([9]), 0.3)
    with pytest.warns(UserWarning, match="could not be built"):
        assert not sparse_native.supports(queries, keys, keys)
    selection = Selection(torch.arange(10).view(1, 1, 10))
    got = finish(sparse_attention_state(queries, keys, keys, torch.arange(10).view(1, 1, 10), selection), queries)
    dense = torch.nn.functional.scaled_dot_product_attention(queries.values, keys, keys, scale=0.3)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits, rows", [(2, 1), (4, 1), (8, 3), (16, 2)])
def test_label_scores_kernel_equals_the_definition(bits, rows):
    """Double Sparsity's scores from packed labels read in place (buffers with room past the slots scored) equal
    max over each KV head's query heads and rows of q . (code * scale + min) / sqrt(r), written out here."""
    from kvpress.formats.lowbit import pack, quantize
    from kvpress.kernels.labels import label_scores, label_scores_reference

    torch.manual_seed(bits)
    B, HKV, G, T, ROOM, R = 2, 3, 2, 700, 760, 8
    raw = torch.randn(B, HKV * G, ROOM, R)
    if bits == 16:
        labels, exact = (raw.half(), None, None), raw.half().float()
    else:
        codes, scale, low = quantize(raw, bits, dim=-1)
        labels = (pack(codes, bits), scale, low)
        exact = codes.float() * scale.float()[..., None] + low.float()[..., None]
    q = torch.randn(B, HKV * G, rows, R)
    expected = torch.einsum("bhrc,bhtc->bhrt", q, exact[:, :, :T]).div(R ** 0.5)
    expected = expected.reshape(B, HKV, G * rows, T).amax(2)
    torch.testing.assert_close(label_scores(q, labels, bits, T, HKV), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(label_scores_reference(q, labels, bits, T, HKV), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget, own", [(40, 1), (5, 3), (500, 2), (0, 1)])
def test_top_slots_kernel_selects_what_the_definition_selects(budget, own):
    """Per head: the step's own real slots and the `budget` best other real slots with a finite score (fewer where
    fewer qualify), in slot order, padded to the widest head; written out here with a sort per head."""
    from kvpress.kernels.slots import top_slots, top_slots_reference

    torch.manual_seed(budget + own)
    B, HKV, T = 2, 3, 300
    scores = torch.randn(B, HKV, T)
    scores[0, 0, :50] = float("-inf")  # masked slots are never chosen
    real = torch.rand(B, HKV, T) > 0.1
    real[1, 2, :] = False  # a head with no real slot selects nothing
    indices, valid = top_slots(scores, real, budget, T - own)
    for b in range(B):
        for h in range(HKV):
            candidates = [t for t in range(T - own) if real[b, h, t] and scores[b, h, t] > float("-inf")]
            best = sorted(candidates, key=lambda t: -float(scores[b, h, t]))[:budget]
            expected = sorted(best + [t for t in range(T - own, T) if real[b, h, t]])
            assert indices[b, h][valid[b, h]].tolist() == expected
    ref_indices, ref_valid = top_slots_reference(scores, real, budget, T - own)
    assert torch.equal(valid, ref_valid) and torch.equal(indices[valid], ref_indices[ref_valid])
