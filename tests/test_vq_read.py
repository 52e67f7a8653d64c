"""Attention over CommVQ codes without a decoded copy (kernels/vq_read.py, vq_read_cpu.c), checked against attention
written out here over the keys and values the codes decode to (formats/commvq.decode, RoPE by explicit angles): the C
kernel and the torch reference, with GQA, several groups, key and value stage counts that differ, query rows under a
causal mask, fillers, a sliding window, softcap, splits over many slots, a flat store's runs, an earlier state."""

import pytest
import torch

from kvpress.formats import commvq as cv
from kvpress.kernels import vq_read
from kvpress.kernels.online_softmax import Queries, empty_state, finish, merge_states
from kvpress.kernels.sparse_attention import run_grid

THETA = 10000.0


def _setup(batch=2, hkv=2, n=300, groups=2, pairs=4, key_stages=3, value_stages=2, seed=0, consecutive=True):
    g = torch.Generator().manual_seed(seed)
    dim = 2 * groups * pairs
    tables = {kind: torch.complex(torch.randn(hkv, groups, s, pairs, 64, generator=g),
                                  torch.randn(hkv, groups, s, pairs, 64, generator=g)) * 0.3
              for kind, s in (("keys", key_stages), ("values", value_stages))}
    codes = {kind: torch.randint(0, 4096, (batch, hkv, n, groups, s), generator=g)
             for kind, s in (("keys", key_stages), ("values", value_stages))}
    norms = {kind: (torch.rand(batch, hkv, n, generator=g) * 3 + 0.5).half() for kind in ("keys", "values")}
    if consecutive:
        rope = (torch.arange(n) + torch.tensor([0, 7])[:batch, None, None]).expand(batch, hkv, n)
    else:
        rope = torch.randint(0, 2 * n, (batch, hkv, n), generator=g)
    packed = cv.pack12(torch.cat([codes["keys"].flatten(-2), codes["values"].flatten(-2)], -1))
    slots = vq_read.VQSlots(packed, norms["keys"], norms["values"], rope.to(torch.int32))
    inv_freq = THETA ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = torch.arange(4 * n, dtype=torch.float64)[:, None] * inv_freq
    weights = {kind: torch.stack([cv.bag_weights(tables[kind][h]) for h in range(hkv)]) for kind in tables}
    vq_tables = vq_read.VQTables(weights["keys"], weights["values"], angles.cos().float(), angles.sin().float())
    # the definition: decode each vector, RoPE the key at its position
    keys, values = [], []
    for h in range(hkv):
        keys.append(cv.decode(codes["keys"][:, h], norms["keys"][:, h], cv.bag_weights(tables["keys"][h])))
        values.append(cv.decode(codes["values"][:, h], norms["values"][:, h], cv.bag_weights(tables["values"][h])))
    keys, values = torch.stack(keys, 1).double(), torch.stack(values, 1).double()
    angle = rope.double()[..., None] * inv_freq  # [B, Hkv, n, D / 2]
    re, im = keys[..., :dim // 2], keys[..., dim // 2:]
    keys = torch.cat([re * angle.cos() - im * angle.sin(), im * angle.cos() + re * angle.sin()], -1)
    return slots, vq_tables, keys, values


def _written_out(q, keys, values, allowed, scaling, softcap=None):
    """softmax(q k / sqrt(d)) v per query head, each under its KV head (GQA), in float64."""
    batch, hq, rows, dim = q.shape
    group = hq // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    logits = q.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed.repeat_interleave(group, 1), float("-inf"))
    return logits.softmax(-1) @ v


def _queries(batch, hq, rows, dim, positions, seed=1, **kwargs):
    g = torch.Generator().manual_seed(seed)
    return Queries(torch.randn(batch, hq, rows, dim, generator=g), positions, dim ** -0.5, **kwargs)


def _allowed(queries, positions, valid):
    return queries.allowed(positions, valid)  # [B, Hkv, r, T]


@pytest.mark.parametrize("reader", ["native", "reference"])
@pytest.mark.parametrize("case", ["decode", "rows", "fillers", "window", "softcap", "scattered_rope"])
def test_reads_the_attention_written_out_over_the_decoded_codes(reader, case):
    if reader == "native" and not vq_read.available():
        pytest.skip("no C compiler")
    n, batch, hkv, group = 300, 2, 2, 3
    slots, tables, keys, values = _setup(batch, hkv, n, consecutive=case != "scattered_rope")
    dim = keys.shape[-1]
    positions = torch.arange(n).expand(batch, hkv, n)
    valid = None
    kwargs = {}
    rows, q_pos = 1, torch.tensor([n])
    if case in ("rows", "window"):
        rows, q_pos = 5, torch.tensor([40, 120, 250, 299, 301])
    if case == "window":
        kwargs["sliding_window"] = 64
    if case == "softcap":
        kwargs["softcap"] = 2.0
    if case == "fillers":
        valid = torch.rand(batch, hkv, n, generator=torch.Generator().manual_seed(5)) > 0.3
        valid[1, 0] = False  # a head with no real slot
    queries = _queries(batch, hkv * group, rows, dim, q_pos, **kwargs)
    read = vq_read.vq_attention_state if reader == "native" else vq_read.vq_attention_state_reference
    if reader == "native":
        assert vq_read.supports(queries, slots, tables)
    state = read(queries, slots, tables, positions, valid)
    allowed = _allowed(queries, positions, valid)
    expected = _written_out(queries.values, keys, values, allowed, queries.scaling, kwargs.get("softcap"))
    got = finish(state, queries)
    empty = ~allowed.any(-1).repeat_interleave(group, 1)  # [B, Hq, r]: rows that read nothing
    assert torch.allclose(got[~empty].double(), expected[~empty], atol=2e-4, rtol=1e-4)
    assert (state[1].view(batch, hkv * group, rows)[empty] == 0).all()


def test_an_earlier_state_and_the_kernel_and_reference_agree():
    """A read folds into the state it is given; the kernel's state (max, sum, accumulator) is the reference's."""
    if not vq_read.available():
        pytest.skip("no C compiler")
    slots, tables, keys, values = _setup(1, 2, 600, seed=3)
    queries = _queries(1, 4, 1, keys.shape[-1], torch.tensor([700]))
    positions = torch.arange(600).expand(1, 2, 600)
    native = vq_read.vq_attention_state(queries, slots, tables, positions)
    reference = vq_read.vq_attention_state_reference(queries, slots, tables, positions)
    for a, b in zip(native, reference):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    first = vq_read.VQSlots(*(t[:, :, :250] for t in (slots.codes, slots.k_norm, slots.v_norm, slots.rope)))
    rest = vq_read.VQSlots(*(t[:, :, 250:] for t in (slots.codes, slots.k_norm, slots.v_norm, slots.rope)))
    state = vq_read.vq_attention_state(queries, first, tables, positions[:, :, :250])
    state = vq_read.vq_attention_state(queries, rest, tables, positions[:, :, 250:], state=state)
    assert torch.allclose(finish(state, queries), finish(native, queries), atol=1e-5)
    assert torch.allclose(finish(merge_states(empty_state(queries.grouped(2)), native), queries),
                          finish(native, queries))


def test_a_flat_stores_runs_read_as_their_padded_grid():
    """The reader gathers a flat store's (row, head) runs with run_grid: the result is each run read alone (here
    head h's runs are taken from head h's coded slots)."""
    slots, tables, keys, values = _setup(1, 2, 90, seed=4)
    lengths = torch.tensor([[30, 20], [40, 0]])
    starts = torch.tensor([[0, 30], [50, 90]])
    indices, ok = run_grid(starts, lengths, 40, 90)
    head = torch.arange(2).view(1, 2, 1).expand_as(indices)
    flat = vq_read.VQSlots(*(t[0][head, indices] for t in (slots.codes, slots.k_norm, slots.v_norm, slots.rope)))
    positions = torch.arange(90)[indices]
    queries = _queries(2, 4, 1, keys.shape[-1], torch.tensor([100]))
    for read in (vq_read.vq_attention_state, vq_read.vq_attention_state_reference):
        got = finish(read(queries, flat, tables, positions, ok), queries)
        for b in range(2):
            for h in range(2):
                if lengths[b, h] == 0:
                    continue
                run = slice(int(starts[b, h]), int(starts[b, h] + lengths[b, h]))
                expected = _written_out(queries.values[b:b + 1, 2 * h:2 * h + 2], keys[:, h:h + 1, run],
                                        values[:, h:h + 1, run], torch.ones(1, 1, 1, lengths[b, h], dtype=torch.bool),
                                        queries.scaling)
                assert torch.allclose(got[b:b + 1, 2 * h:2 * h + 2].double(), expected, atol=2e-4)


def test_without_a_compiler_the_reference_reads(monkeypatch):
    slots, tables, keys, values = _setup(1, 1, 50)
    queries = _queries(1, 2, 1, keys.shape[-1], torch.tensor([60]))
    positions = torch.arange(50).expand(1, 1, 50)
    monkeypatch.setattr(vq_read, "available", lambda: False)
    assert not vq_read.supports(queries, slots, tables)
    got = finish(vq_read.vq_attention_state(queries, slots, tables, positions), queries)
    expected = _written_out(queries.values, keys, values, torch.ones(1, 1, 1, 50, dtype=torch.bool), queries.scaling)
    assert torch.allclose(got.double(), expected, atol=2e-4)
