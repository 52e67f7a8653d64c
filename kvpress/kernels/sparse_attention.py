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


def run_grid(starts: torch.Tensor, lengths: torch.Tensor, width: int, num_slots: int):
    """(indices [B, Hkv, width] into a flat store of `num_slots`, ok [B, Hkv, width]) of the per-(row, head) runs
    starting at `starts` with `lengths` slots; entries past a run point at slot 0 and are not ok."""
    rank = torch.arange(width, device=lengths.device)
    ok = rank < lengths[..., None]
    indices = (starts[..., None] + rank).clamp(max=max(num_slots - 1, 0))
    return torch.where(ok, indices, 0), ok


def flat_attention_state(queries: Queries, keys, values, positions, starts: torch.Tensor, lengths: torch.Tensor,
                         state: State | None = None, use_triton: bool | None = None) -> State:
    """Attention over a flat store ([N, D] keys/values, [N] positions) whose (row, KV head) runs start at `starts`
    [B, Hkv] with `lengths` [B, Hkv] slots. On CUDA: the sparse Triton kernel over the runs' indices. Elsewhere: each
    run is a contiguous slice of the store, read in place (one small block update per run), instead of the
    reference's gathered, padded copy of the whole layer per call."""
    from . import triton_sparse

    if use_triton is None:
        use_triton = queries.values.is_cuda and triton_sparse.available() and queries.softcap is None
    if use_triton:
        width = int(lengths.max()) if lengths.numel() else 0
        return sparse_attention_state(queries, keys, values, positions,
                                      Selection(*run_grid(starts, lengths, width, keys.shape[0])), state, True)
    if queries.values.shape[2] <= _VECTOR_ROWS:
        part = _flat_runs_vectorised(queries, keys, values, positions, lengths)
        return part if state is None else merge_states(state, part)
    batch, hkv = lengths.shape
    q = queries.grouped(hkv)
    m, l, acc = empty_state(q) if state is None else (t.clone() for t in state)
    dim = keys.shape[-1]
    for b, (row_starts, row_lengths) in enumerate(zip(starts.tolist(), lengths.tolist())):
        for h, (start, n) in enumerate(zip(row_starts, row_lengths)):
            if n == 0:
                continue
            at = (slice(b, b + 1), slice(h, h + 1))
            run = slice(start, start + n)
            allowed = queries.allowed(positions[run].view(1, 1, n))
            m[at], l[at], acc[at] = block_update((m[at], l[at], acc[at]), q[at],
                                                 keys[run].float().view(1, 1, n, dim),
                                                 values[run].float().view(1, 1, n, -1), queries.scaling,
                                                 queries.softcap, allowed)
    return m, l, acc


_VECTOR_ROWS = 4  # query rows up to which every run is read at once (decode steps, short verifications)


def _flat_runs_vectorised(queries: Queries, keys, values, positions, lengths) -> State:
    """Every run at once for a few query rows: each slot is paired with its own (row, head)'s queries (a gather of
    queries, not of keys), and the per-run softmax is a segment reduction over the store."""
    batch, hkv = lengths.shape
    q = queries.grouped(hkv)
    _, _, group, rows, dim = q.shape
    runs = batch * hkv
    owner = torch.repeat_interleave(torch.arange(runs, device=keys.device), lengths.flatten())  # [N] run of each slot
    logits = torch.einsum("ngrd,nd->ngr", q.reshape(runs, group, rows, dim)[owner], keys.float()) * queries.scaling
    if queries.softcap is not None:
        logits = torch.tanh(logits / queries.softcap) * queries.softcap
    allowed = queries.allowed(positions.view(1, 1, -1))[0, 0]  # [r, N]
    logits = logits.masked_fill(~allowed.T[:, None, :], float("-inf"))
    index = owner[:, None, None].expand_as(logits)
    m = torch.full((runs, group, rows), float("-inf"), device=keys.device).scatter_reduce(0, index, logits, "amax")
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - safe[owner])
    l = torch.zeros_like(m).index_add_(0, owner, p)
    acc = torch.zeros(runs, group, rows, values.shape[-1], device=keys.device)
    acc.index_add_(0, owner, p[..., None] * values.float()[:, None, None, :])
    return m.view(batch, hkv, group, rows), l.view(batch, hkv, group, rows), acc.view(batch, hkv, group, rows, -1)


def sparse_attention(queries: Queries, keys, values, positions, selection: Selection,
                     use_triton: bool | None = None) -> torch.Tensor:
    """Output [B, Hq, q_len, D]."""
    return finish(sparse_attention_state(queries, keys, values, positions, selection, use_triton=use_triton),
                  queries)
