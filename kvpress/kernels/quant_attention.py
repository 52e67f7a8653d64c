"""Attention over low-bit storage (KIVI / GEAR codes), read block by block: no full-precision copy of the codes
is ever made. Any q_len works (decode, verification, chunked prefill). Each function returns the online-softmax
state over the codes' slots, so the layer folds it with its full-precision segments.

`lowbit_attention_state` (rectangular codes [B, Hkv, T]) dispatches: the Triton kernel on CUDA for KIVI codes;
elsewhere `codes_domain_attention_state` for KIVI codes in slot order (the scales are folded into the queries and
the probabilities, so the codes are unpacked once and never rescaled: the fast CPU path), and the torch
reference for the rest (GEAR terms, codes reordered by eviction, the draft's reduced precision). `flat_lowbit_attention_state` reads a flat store of per-head runs (codes
[1, 1, N] of a flat segment): each block of the store is dequantized once and every (row, head) reads its
part of the block through the sparse-gather path. Torch only (no Triton kernel for flat codes yet).
"""

from __future__ import annotations

import torch

from ..cache.codecs import LowBitCodes, unpack_floats
from .online_softmax import Queries, State, block_update, empty_state, merge_states
from .sparse_attention import Selection, sparse_attention_state_reference


def lowbit_attention_state_reference(queries: Queries, codes: LowBitCodes, positions, valid=None,
                                     state: State | None = None, precision: int | None = None,
                                     block: int = 4096) -> State:
    """positions/valid [B, Hkv, T] of the codes' slots. precision=4 reads an 8-bit segment's upper nibbles only
    (the draft view of self-speculation)."""
    hkv = codes.k_codes.shape[1]
    q = queries.grouped(hkv)
    state = empty_state(q) if state is None else state
    allowed = queries.allowed(positions, valid)  # [B, Hkv, r, T]
    for start in range(0, codes.num_slots, block):
        end = min(codes.num_slots, start + block)
        keys, values = codes.dequantize(start, end, precision)
        state = block_update(state, q, keys, values, queries.scaling, queries.softcap, allowed[..., start:end])
    return state


def codes_domain_attention_state(queries: Queries, codes: LowBitCodes, positions, valid=None,
                                 state: State | None = None) -> State:
    """The reference's result for KIVI codes whose key groups are implicit (slot // group_size), with fewer
    passes over the slots: the codes are unpacked straight into one float buffer per tensor; keys are rescaled
    in place (scale and min per group of slots, broadcast) and read by one matmul; values are never rescaled:
    a value is scale[slot, channel group] * code + min[...], so the output is (p * scale) @ codes + p @ min per
    channel group."""
    hkv = codes.k_codes.shape[1]
    q = queries.grouped(hkv)
    batch, _, group, rows, dim = q.shape
    state = empty_state(q) if state is None else state
    length, g = codes.num_slots, codes.group_size
    if length == 0:
        return state
    n_rows = group * rows
    keys = unpack_floats(codes.k_codes, codes.bits).view(batch, hkv, length // g, g, dim)
    keys = keys.mul_(codes.k_scale[:, :, :, None].float()).add_(codes.k_min[:, :, :, None].float())
    logits = q.reshape(batch, hkv, n_rows, dim) @ keys.view(batch, hkv, length, dim).transpose(-1, -2)
    logits = logits * queries.scaling  # [B, H, R, T]
    if queries.softcap is not None:
        logits = torch.tanh(logits / queries.softcap) * queries.softcap
    allowed = queries.allowed(positions, valid)[:, :, None].expand(-1, -1, group, -1, -1)
    logits = logits.masked_fill(~allowed.reshape(batch, hkv, n_rows, length), float("-inf"))
    m = logits.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - safe[..., None])
    values = unpack_floats(codes.v_codes, codes.bits)  # [B, H, T, D]
    v_scale = codes.v_scale.float()  # [B, H, T, D / g]
    acc = (p @ codes.v_min.float()).repeat_interleave(g, -1)  # the mins' part, [B, H, R, D]
    for c in range(v_scale.shape[-1]):
        acc[..., c * g:(c + 1) * g] += (p * v_scale[:, :, None, :, c]) @ values[..., c * g:(c + 1) * g]
    part = (m.view(batch, hkv, group, rows), p.sum(-1).view(batch, hkv, group, rows),
            acc.view(batch, hkv, group, rows, dim))
    return merge_states(state, part)


def lowbit_attention_state(queries: Queries, codes: LowBitCodes, positions, valid=None, state: State | None = None,
                           precision: int | None = None, use_triton: bool | None = None) -> State:
    from . import triton_quant

    if use_triton is None:
        use_triton = (queries.values.is_cuda and triton_quant.available() and codes.k_lr is None
                      and queries.softcap is None)
    if not use_triton:
        if (codes.k_lr is None and codes.k_group is None and precision in (None, codes.bits)
                and codes.num_slots % codes.group_size == 0):
            return codes_domain_attention_state(queries, codes, positions, valid, state)
        return lowbit_attention_state_reference(queries, codes, positions, valid, state, precision)
    part = triton_quant.lowbit_attention_state_triton(queries, codes, positions, valid, precision)
    return part if state is None else merge_states(state, part)


def flat_lowbit_attention_state(queries: Queries, codes: LowBitCodes, positions, lengths, state: State | None = None,
                                precision: int | None = None, block: int = 4096) -> State:
    """codes/positions [1, 1, N]: one flat store, each (row, head) a contiguous run of `lengths` [B, Hkv] slots in
    (row, head) order."""
    batch, hkv = lengths.shape
    q = queries.grouped(hkv)
    state = empty_state(q) if state is None else state
    flat_lengths = lengths.flatten()
    starts = (flat_lengths.cumsum(0) - flat_lengths).view_as(lengths)
    ends = starts + lengths
    for lo in range(0, codes.num_slots, block):
        hi = min(codes.num_slots, lo + block)
        first = (starts - lo).clamp(0, hi - lo)  # each run's part of this block, relative to the block
        count = (ends - lo).clamp(0, hi - lo) - first
        width = int(count.max())
        if width == 0:
            continue
        keys, values = codes.dequantize(lo, hi, precision)
        rank = torch.arange(width, device=lengths.device)
        ok = rank < count[..., None]
        indices = torch.where(ok, first[..., None] + rank, 0)
        state = sparse_attention_state_reference(queries, keys[0, 0], values[0, 0], positions[0, 0, lo:hi],
                                                 Selection(indices, ok), state)
    return state
