"""Attention over CommVQ codes (formats/commvq.py) without a decoded copy of the cache, from plain tensors.

Keys: each slot's key is its codewords' sum, rotated at its RoPE position and scaled by its norm; it is needed once
per slot, for every query row of its KV head. Values need no decoding at all: the output is linear in them, so

    sum_j p_j v_j = sum_j p_j n_j sum_s (row a_js + row b_js of the table) = sum_rows c_row * row,
    c_row = sum of p_j n_j over the slots j whose codes name that row,

a histogram of the attention weights over the 2 S x 64 table rows of each group, met with the table once per call.

`vq_attention_state` runs vq_read_cpu.c on CPU where it builds (each key decoded in registers, the histogram in a
work buffer); `vq_attention_state_reference` is the same computation in torch (keys decoded into a transient copy,
the histogram by scatter_add), used on GPU and where no compiler works."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats.commvq import ENTRIES, unpack12
from .native import NativeLibrary
from .online_softmax import Queries, State, by_row_blocks, empty_state, merge_states

SOURCE = Path(__file__).with_name("vq_read_cpu.c")
MAX_HEAD_DIM = 1024  # the kernel decodes a key into a stack buffer of this many floats
MIN_SPLIT = 256  # slots per work item, at least
HISTOGRAM_FLOATS = 1 << 21  # per kernel call: query rows are read in blocks whose histograms stay this small


@dataclass(frozen=True)
class VQSlots:
    """Coded slots [B, Hkv, T]: codes uint8 [B, Hkv, T, bytes] (each slot's key codes [G, Sk], then its value codes
    [G, Sv], 12 bits each, formats/commvq.pack12), norms fp16, RoPE positions int32 (each key's)."""

    codes: torch.Tensor
    k_norm: torch.Tensor
    v_norm: torch.Tensor
    rope: torch.Tensor


@dataclass(frozen=True)
class VQTables:
    """One layer's decoder: weights fp32 [Hkv, G, 2 S 64, 2P] of keys and values (formats/commvq.bag_weights per
    head), and cos / sin fp32 [positions, D / 2] of its RoPE by position."""

    keys: torch.Tensor
    values: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(groups, pairs per group, key stages, value stages)."""
        groups, key_rows, width = self.keys.shape[1:]
        return groups, width // 2, key_rows // (2 * ENTRIES), self.values.shape[2] // (2 * ENTRIES)


# ---------------------------------------------------------------------------- the torch reference
def _decoded_keys(codes: torch.Tensor, slots: VQSlots, tables: VQTables) -> torch.Tensor:
    """fp32 post-RoPE keys [B, Hkv, T, D] from the key codes [B, Hkv, T, G * Sk]."""
    groups, pairs, stages, _ = tables.shape
    batch, hkv, n = codes.shape[:3]
    codes = codes.view(batch, hkv, n, groups, stages)
    head = torch.arange(hkv, device=codes.device).view(1, hkv, 1, 1)
    group = torch.arange(groups, device=codes.device).view(1, 1, 1, groups)
    x = torch.zeros(batch, hkv, n, groups, 2 * pairs, device=codes.device)
    for s in range(stages):
        x += tables.keys[head, group, s * ENTRIES + codes[..., s] // ENTRIES]
        x += tables.keys[head, group, (stages + s) * ENTRIES + codes[..., s] % ENTRIES]
    re, im = x[..., :pairs].flatten(-2), x[..., pairs:].flatten(-2)  # [B, Hkv, T, D / 2] each, groups in order
    rope = slots.rope.long()
    cos, sin = tables.cos[rope], tables.sin[rope]
    norm = slots.k_norm.float()[..., None]
    return torch.cat([re * cos - im * sin, im * cos + re * sin], -1) * norm


def _histogram_output(codes: torch.Tensor, weights: torch.Tensor, tables: VQTables) -> torch.Tensor:
    """acc [B, Hkv, M, D] = sum_j weights[..., j] v_j / n_j for value codes [B, Hkv, T, G * Sv] and weights
    [B, Hkv, M, T] (already times the value norms)."""
    groups, pairs, _, stages = tables.shape
    batch, hkv, n = codes.shape[:3]
    rows = weights.shape[2]
    codes = codes.view(batch, hkv, n, groups, stages)
    hist = weights.new_zeros(batch, hkv, rows, groups, 2 * stages * ENTRIES)
    for g in range(groups):
        for s in range(stages):
            halves = (s * ENTRIES + codes[..., g, s] // ENTRIES, (stages + s) * ENTRIES + codes[..., g, s] % ENTRIES)
            for bin_of in halves:
                hist[:, :, :, g].scatter_add_(-1, bin_of[:, :, None, :].expand(-1, -1, rows, -1), weights)
    part = torch.einsum("bhmgr,hgrw->bhmgw", hist, tables.values)  # [B, Hkv, M, G, 2P]
    return torch.cat([part[..., :pairs].flatten(-2), part[..., pairs:].flatten(-2)], -1)


def vq_attention_state_reference(queries: Queries, slots: VQSlots, tables: VQTables, positions: torch.Tensor,
                                 valid: torch.Tensor | None = None, state: State | None = None) -> State:
    """The online-softmax state of `queries` over coded slots [B, Hkv, T] at `positions` (original, for the mask)
    with validity `valid`: keys decoded, values read through the histogram (module docstring)."""
    batch, hkv, n = slots.k_norm.shape
    q = queries.grouped(hkv)
    state = empty_state(q) if state is None else state
    if n == 0:
        return state
    groups, _, key_stages, value_stages = tables.shape
    codes = unpack12(slots.codes, groups * (key_stages + value_stages))
    keys = _decoded_keys(codes[..., :groups * key_stages], slots, tables)
    _, _, group, rows, dim = q.shape
    logits = (q.reshape(batch, hkv, group * rows, dim) @ keys.transpose(-1, -2)) * queries.scaling
    if queries.softcap is not None:
        logits = torch.tanh(logits / queries.softcap) * queries.softcap
    logits = logits.masked_fill(~queries.allowed_by_row(positions, valid, group), float("-inf"))
    m = logits.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - safe[..., None])
    acc = _histogram_output(codes[..., groups * key_stages:], p * slots.v_norm.float()[:, :, None], tables)
    shape = (batch, hkv, group, rows)
    return merge_states(state, (m.view(shape), p.sum(-1).view(shape), acc.view(*shape, dim)))


# ---------------------------------------------------------------------------- the CPU kernel
def _declare(library) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.vq_attention.argtypes = [ptr, i64] + [ptr] * 7 + [i64] * 5 + [ptr, ptr, i64, i64, i64, ctypes.c_float,
                                                                       ctypes.c_float, i64, ctypes.c_int] + [ptr] * 3
    library.vq_attention.restype = ctypes.c_int


_native = NativeLibrary(SOURCE, _declare, "the CPU CommVQ read kernel",
                        "CommVQ codes are read through torch instead (same results, slower)")


def available() -> bool:
    return _native.get() is not None


def supports(queries: Queries, slots: VQSlots, tables: VQTables) -> bool:
    """On CPU, outside torch.compile, with fp16 norms and a rotary over every channel (cos / sin [., D / 2])."""
    dim = queries.values.shape[-1]
    return (not torch.compiler.is_compiling() and not queries.values.is_cuda and dim <= MAX_HEAD_DIM
            and slots.k_norm.dtype == slots.v_norm.dtype == torch.float16 and tables.cos.shape[-1] * 2 == dim
            and available())


def vq_attention_state(queries: Queries, slots: VQSlots, tables: VQTables, positions: torch.Tensor,
                       valid: torch.Tensor | None = None, state: State | None = None) -> State:
    """vq_attention_state_reference's state, by vq_read_cpu.c where `supports` holds."""
    if not supports(queries, slots, tables):
        return vq_attention_state_reference(queries, slots, tables, positions, valid, state)
    batch, hkv, n = slots.k_norm.shape
    if n == 0:
        return empty_state(queries.grouped(hkv)) if state is None else state
    groups, _, _, value_stages = tables.shape
    group = queries.values.shape[1] // hkv
    rows_per_call = max(1, HISTOGRAM_FLOATS // (group * groups * 2 * value_stages * ENTRIES))
    part = by_row_blocks(queries, rows_per_call, lambda block: _run(block, slots, tables, positions, valid))
    return part if state is None else merge_states(state, part)


def _run(queries: Queries, slots: VQSlots, tables: VQTables, positions, valid) -> State:
    batch, hkv, n = slots.k_norm.shape
    q = queries.grouped(hkv)
    _, _, group, rows, dim = q.shape
    n_rows, heads = group * rows, batch * hkv
    qr = q.reshape(heads, n_rows, dim).contiguous()
    allowed = queries.kernel_mask(positions, valid, group)
    codes, k_norm, v_norm = (t.contiguous() for t in (slots.codes, slots.k_norm, slots.v_norm))
    rope = slots.rope.to(torch.int32).contiguous()
    if int(rope.max()) >= tables.cos.shape[0] or int(rope.min()) < 0:
        raise ValueError(f"vq_attention_state: RoPE positions up to {int(rope.max())}; the cos / sin tables hold "
                         f"positions 0 to {tables.cos.shape[0] - 1}")
    groups, pairs, key_stages, value_stages = tables.shape
    threads = torch.get_num_threads()
    splits = max(1, min(-(-2 * threads // heads), n // MIN_SPLIT))
    m = torch.empty(heads, n_rows)
    l, acc = torch.empty_like(m), torch.empty(heads, n_rows, dim)
    failed = _native.get().vq_attention(
        codes.data_ptr(), codes.shape[-1], k_norm.data_ptr(), v_norm.data_ptr(), rope.data_ptr(),
        tables.cos.data_ptr(), tables.sin.data_ptr(), tables.keys.data_ptr(), tables.values.data_ptr(), hkv, groups,
        pairs, key_stages, value_stages, qr.data_ptr(), None if allowed is None else allowed.data_ptr(), heads, n,
        n_rows, float(queries.scaling), float(queries.softcap or 0.0), splits, threads, m.data_ptr(), l.data_ptr(),
        acc.data_ptr())
    if failed == 2:
        raise ValueError(f"vq_attention_state: head_dim={dim}; allowed values: at most {MAX_HEAD_DIM}")
    if failed:
        raise MemoryError("vq_read_cpu.c: a work buffer could not be allocated")
    shape = (batch, hkv, group, rows)
    return m.view(shape), l.view(shape), acc.view(*shape, dim)
