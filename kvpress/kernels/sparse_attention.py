"""Attention over a per-(row, KV head) subset of stored slots, without materialising the gathered K/V.

indices [B, Hkv, K] are slot numbers into keys/values [B, Hkv, T, D]; index_valid [B, Hkv, K] marks real
entries (ragged counts are padded with invalid ones). Masking is the usual one (allowed_mask) applied to the
selected slots' original positions. Any q_len works. Output [B, Hq, q_len, D].
`sparse_attention` dispatches: Triton on CUDA, the torch reference (gathers one block of indices at a time)
elsewhere.
"""

from __future__ import annotations

import torch

from .online_softmax import block_update, empty_state, finish
from .scores import allowed_mask


def sparse_attention_reference(query, keys, values, indices, index_valid, key_positions, query_positions, scaling,
                               sliding_window=None, softcap=None, block: int = 1024):
    return finish(sparse_attention_state_reference(query, keys, values, indices, index_valid, key_positions,
                                                   query_positions, scaling, sliding_window, softcap, block), query)


def sparse_attention_state_reference(query, keys, values, indices, index_valid, key_positions, query_positions,
                                     scaling, sliding_window=None, softcap=None, block: int = 1024):
    """The online-softmax state (max, sum, acc) over the indexed slots, before normalisation, so callers can
    merge it with other parts of a layer (see ragged_attention). keys/values/key_positions may be expanded
    views (stride 0 over rows and heads) of one flat store."""
    batch, hq, rows, dim = query.shape
    hkv = indices.shape[1]
    q = query.reshape(batch, hkv, hq // hkv, rows, dim).float()
    state = empty_state(q)
    for start in range(0, indices.shape[-1], block):
        idx = indices[..., start:start + block]
        gather = idx[..., None].expand(-1, -1, -1, dim)
        pos = key_positions.gather(-1, idx)
        ok = None if index_valid is None else index_valid[..., start:start + block]
        allowed = allowed_mask(query_positions, pos, ok, sliding_window)
        if ok is not None:  # after allowed_mask's self rule: padded index entries may repeat the current slot
            allowed = allowed & ok[:, :, None, :]
        state = block_update(state, q, keys.gather(2, gather).float(), values.gather(2, gather).float(), scaling,
                             softcap, allowed)
    return state


def sparse_attention(query, keys, values, indices, index_valid, key_positions, query_positions, scaling,
                     sliding_window=None, softcap=None):
    from . import triton_sparse

    if query.is_cuda and triton_sparse.available() and softcap is None:
        return triton_sparse.sparse_attention_triton(query, keys, values, indices, index_valid, key_positions,
                                                     query_positions, scaling, sliding_window)
    return sparse_attention_reference(query, keys, values, indices, index_valid, key_positions, query_positions,
                                      scaling, sliding_window, softcap)
