"""Attention over low-bit storage (KIVI / GEAR codes), read block by block: no full-precision copy of the codes
is ever made. Any q_len works (decode, verification, chunked prefill). Each function returns the online-softmax
state over the codes' slots, so the layer folds it with its full-precision segments.

`lowbit_attention_state` (rectangular codes [B, Hkv, T]) dispatches: the Triton kernel on CUDA for KIVI codes,
the torch reference otherwise. `flat_lowbit_attention_state` reads a flat store of per-head runs (codes
[1, 1, N] of a flat segment): each block of the store is dequantized once and every (row, head) reads its
part of the block through the sparse-gather path. Torch only (no Triton kernel for flat codes yet).
"""

from __future__ import annotations

import torch

from ..cache.codecs import LowBitCodes
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


def lowbit_attention_state(queries: Queries, codes: LowBitCodes, positions, valid=None, state: State | None = None,
                           precision: int | None = None, use_triton: bool | None = None) -> State:
    from . import triton_quant

    if use_triton is None:
        use_triton = (queries.values.is_cuda and triton_quant.available() and codes.k_lr is None
                      and queries.softcap is None)
    if not use_triton:
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
