"""Attention over a per-(row, KV head) subset of stored slots, without materialising the gathered K/V.

`Selection.indices` [B, Hkv, K] are slot numbers into keys/values [B, Hkv, T, D], or into one flat store [N, D]
shared by every (row, head) (flat storage segments: each head's run is a range of the store). `valid` marks
real entries (ragged counts are padded with invalid ones). Masking is the usual one (allowed_mask) applied to
the selected slots' original positions. Any q_len works. `sparse_attention_state` dispatches: Triton on CUDA,
the torch reference (gathers one block of indices at a time) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .online_softmax import Queries, State, block_update, empty_state, finish, merge_states


@dataclass(frozen=True)
class Selection:
    indices: torch.Tensor  # [B, Hkv, K] slot numbers
    valid: torch.Tensor | None = None  # [B, Hkv, K] real entries (None: all)


def sparse_attention_state_reference(queries: Queries, keys, values, positions, selection: Selection,
                                     state: State | None = None, block: int = 1024) -> State:
    """keys/values/positions may be a flat store ([N, D], [N]) shared by every (row, head)."""
    indices = selection.indices
    batch, hkv = indices.shape[:2]
    if keys.dim() == 2:  # a flat store seen by every (row, head): an expanded view, no copy
        keys, values, positions = (t.view(1, 1, *t.shape).expand(batch, hkv, *t.shape)
                                   for t in (keys, values, positions))
    q = queries.grouped(hkv)
    state = empty_state(q) if state is None else state
    dim = keys.shape[-1]
    for start in range(0, indices.shape[-1], block):
        idx = indices[..., start:start + block]
        gather = idx[..., None].expand(-1, -1, -1, dim)
        ok = None if selection.valid is None else selection.valid[..., start:start + block]
        allowed = queries.allowed(positions.gather(-1, idx), ok)
        if ok is not None:  # after allowed_mask's self rule: padded index entries may repeat the current slot
            allowed = allowed & ok[:, :, None, :]
        state = block_update(state, q, keys.gather(2, gather).float(), values.gather(2, gather).float(),
                             queries.scaling, queries.softcap, allowed)
    return state


def sparse_attention_state(queries: Queries, keys, values, positions, selection: Selection,
                           state: State | None = None, use_triton: bool | None = None) -> State:
    from . import triton_sparse

    if use_triton is None:
        use_triton = queries.values.is_cuda and triton_sparse.available() and queries.softcap is None
    if not use_triton:
        return sparse_attention_state_reference(queries, keys, values, positions, selection, state)
    part = triton_sparse.sparse_attention_state_triton(queries, keys, values, positions, selection)
    return part if state is None else merge_states(state, part)


def sparse_attention(queries: Queries, keys, values, positions, selection: Selection,
                     use_triton: bool | None = None) -> torch.Tensor:
    """Output [B, Hq, q_len, D]."""
    return finish(sparse_attention_state(queries, keys, values, positions, selection, use_triton=use_triton),
                  queries)
