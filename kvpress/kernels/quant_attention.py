"""Attention over a layer whose older slots are low-bit (KIVI / GEAR) and newer slots full precision.

`quantized_attention` dispatches: the Triton kernel on CUDA for KIVI segments, the torch reference otherwise.
Both read the packed codes block by block with an online softmax (flash-decoding style): no full-precision
copy of the cache is ever made. Any q_len works (decode, verification, chunked prefill).
Output: [B, Hq, q_len, D] in the query's dtype.
"""

from __future__ import annotations

import torch

from ..cache.codecs import QuantizedSegment
from .online_softmax import block_update, empty_state, finish
from .scores import allowed_mask


def quantized_attention_reference(
    query: torch.Tensor,
    segment: QuantizedSegment,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    query_positions: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    precision: int | None = None,
    block: int = 1024,
) -> torch.Tensor:
    """Torch reference: dequantizes one block of `block` slots at a time. precision=4 reads an 8-bit segment's
    upper nibbles only (the draft view of self-speculation)."""
    batch, hq, rows, dim = query.shape
    hkv = residual_keys.shape[1]
    q = query.reshape(batch, hkv, hq // hkv, rows, dim).float()
    state = empty_state(q)
    allowed = allowed_mask(query_positions, key_positions, key_valid, sliding_window)  # [B,Hkv,r,T]
    n_q = segment.num_slots
    for start in range(0, n_q, block):
        end = min(n_q, start + block)
        keys, values = segment.dequantize(start, end, precision)
        state = block_update(state, q, keys, values, scaling, softcap, allowed[..., start:end])
    if residual_keys.shape[2]:
        state = block_update(state, q, residual_keys.float(), residual_values.float(), scaling, softcap,
                              allowed[..., n_q:])
    return finish(state, query)


def quantized_attention(query, segment, residual_keys, residual_values, key_positions, key_valid,
                        query_positions, scaling, sliding_window=None, softcap=None, precision=None):
    """Dispatch: Triton on CUDA for plain KIVI segments (no GEAR terms, no soft-capping), else the reference."""
    from . import triton_quant

    if (query.is_cuda and triton_quant.available() and segment.k_lr is None and softcap is None):
        return triton_quant.quantized_attention_triton(
            query, segment, residual_keys, residual_values, key_positions, key_valid, query_positions, scaling,
            sliding_window, precision=precision)
    return quantized_attention_reference(query, segment, residual_keys, residual_values, key_positions, key_valid,
                                         query_positions, scaling, sliding_window, softcap, precision)
