"""Attention over a layer whose oldest slots are ragged per head (a flat RaggedSegment) and whose newest slots
are a rectangular full-precision residual.

The ragged part goes through the sparse-gather kernel: each (row, head) reads its own contiguous run of the
flat store through an index grid, so nothing is padded or copied; the residual joins the same online softmax.
Any q_len works (decode, verification, the next chunk of a chunked prefill). Output [B, Hq, q_len, D].
`ragged_attention` dispatches: Triton on CUDA, the torch reference elsewhere.
"""

from __future__ import annotations

import torch

from .online_softmax import block_update, empty_state, finish
from .scores import allowed_mask
from .sparse_attention import sparse_attention_state_reference


def ragged_attention(query, segment, residual_keys, residual_values, residual_positions, residual_valid,
                     query_positions, scaling, sliding_window=None, softcap=None, use_triton: bool | None = None):
    """segment: a RaggedSegment (keys/values [N, D], positions [N], lengths [B, Hkv]); residual_keys/values
    [B, Hkv, Tr, D] with their positions [B, Hkv, Tr] and validity (None: all real)."""
    from . import triton_sparse

    batch, hq, rows, dim = query.shape
    hkv = segment.lengths.shape[1]
    indices, ok = segment.index_grid()
    if use_triton is None:
        use_triton = query.is_cuda and triton_sparse.available() and softcap is None
    if use_triton:
        state = triton_sparse.sparse_attention_state_triton(
            query, segment.keys, segment.values, indices, ok, segment.positions, query_positions, scaling,
            sliding_window)
    else:
        n = segment.num_tokens

        def shared(t):  # one flat store seen by every (row, head): an expanded view, no copy
            return t.view(1, 1, *t.shape).expand(batch, hkv, *t.shape)

        state = sparse_attention_state_reference(
            query, shared(segment.keys), shared(segment.values), indices, ok, shared(segment.positions), query_positions,
            scaling, sliding_window, softcap) if n else None
    q = query.reshape(batch, hkv, hq // hkv, rows, dim).float()
    if state is None:
        state = empty_state(q)
    if residual_keys.shape[2]:
        allowed = allowed_mask(query_positions, residual_positions, residual_valid, sliding_window)
        state = block_update(state, q, residual_keys.float(), residual_values.float(), scaling, softcap, allowed)
    return finish(state, query)
