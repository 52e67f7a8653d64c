"""Attention over a per-(row, KV head) subset of stored slots, without materialising the gathered K/V.

`Selection.indices` [B, Hkv, K] are slot numbers into keys/values [B, Hkv, T, D], or into one flat store [N, D]
shared by every (row, head) (flat storage segments: each head's run is a range of the store). `valid` marks
real entries (ragged counts are padded with invalid ones). Masking is the usual one (allowed_mask) applied to
the selected slots' original positions. Any q_len works. `sparse_attention_state` dispatches: Triton on CUDA,
the C kernel of sparse_native.py on CPU (rows read in place), the torch reference (gathers one block of indices at
a time) where neither runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sparse_native
from .online_softmax import Queries, State, block_update, dense_attention_state, empty_state, finish, merge_states


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
    from . import triton_sparse  # imports triton where installed: only once a sparse read may run on it

    if use_triton is None:
        use_triton = queries.values.is_cuda and triton_sparse.available() and queries.softcap is None
    if not use_triton and sparse_native.supports(queries, keys, values):
        part = sparse_native.sparse_attention_state_native(queries, keys, values, positions, selection.indices,
                                                           selection.valid)
        return part if state is None else merge_states(state, part)
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
                         state: State | None = None, use_triton: bool | None = None, rect: tuple | None = None) -> State:
    """Attention over a flat store ([N, D] keys/values, [N] positions) whose (row, KV head) runs start at `starts`
    [B, Hkv] with `lengths` [B, Hkv] slots, and over `rect`, rectangular slots read with them (a flat layer's tail:
    keys, values [B, Hkv, t, D], positions [B, Hkv, t], valid [B, Hkv, t] or None). On CUDA: the sparse Triton
    kernel over the runs' indices. Elsewhere: each run is a contiguous slice of the store, read in place, instead of
    the reference's gathered, padded copy of the whole layer per call: for a few query rows, a row's runs and its
    rectangular slots in one softmax; beyond, one small block update per run. A short store (a low-bit layer's
    full-precision window: at most GATHER_SLOTS padded slots) is gathered into its padded grid and read in one
    batched pass: a copy that small costs less than a loop over rows."""
    from . import triton_sparse  # imports triton where installed: only once a sparse read may run on it

    if use_triton is None:
        use_triton = queries.values.is_cuda and triton_sparse.available() and queries.softcap is None
    width = int(lengths.max()) if lengths.numel() else 0
    if not use_triton and lengths.numel() * width <= GATHER_SLOTS:
        indices, ok = run_grid(starts, lengths, width, keys.shape[0])
        state = dense_attention_state(queries, keys[indices], values[indices], positions[indices], ok, state)
        return state if rect is None else dense_attention_state(queries, *rect, state)
    if queries.values.shape[2] <= _DENSE_ROWS and not use_triton:
        part = _flat_rows_dense(queries, keys, values, positions, lengths, rect)
        return part if state is None else merge_states(state, part)
    if use_triton:
        state = sparse_attention_state(queries, keys, values, positions,
                                       Selection(*run_grid(starts, lengths, width, keys.shape[0])), state, True)
        return state if rect is None else dense_attention_state(queries, *rect, state)
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
    return (m, l, acc) if rect is None else dense_attention_state(queries, *rect, (m, l, acc))


_DENSE_ROWS = 4  # query rows up to which a row's runs are read as one dense block (decode steps, verifications)
GATHER_SLOTS = 4096  # padded slots (rows x heads x longest run) up to which a flat store is gathered and read at once


def _flat_rows_dense(queries: Queries, keys, values, positions, lengths, rect) -> State:
    """A few query rows over a flat store (+ `rect`). Runs are laid out row by row, head by head, so one row's runs
    are one contiguous range of the store: all of that row's query heads read the range as one dense block, each
    masked to its own KV head's run, and one softmax covers the row's rectangular slots too. K and V are read once,
    by two matmuls; the logits against the other heads' slots are computed and masked away (Hkv times the
    multiply-adds: cheaper, for a few query rows, than per-slot gathers of queries and segment reductions, which on
    CPU cost more than the full cache's dense attention)."""
    batch, hkv = lengths.shape
    q = queries.grouped(hkv) * queries.scaling  # [B, Hkv, g, r, D]
    _, _, group, rows, dim = q.shape
    heads = torch.arange(hkv, device=keys.device)
    row_ends = lengths.sum(-1).cumsum(0).tolist()
    if rect is not None:
        rect_keys, rect_values, rect_positions, rect_valid = rect
        rect_allowed = queries.allowed(rect_positions, rect_valid)  # [B, Hkv, r, t]
    states = []
    for b, (end, row_lengths) in enumerate(zip(row_ends, lengths)):
        n = int(row_lengths.sum())
        start = end - n
        logits = (q[b].reshape(-1, dim) @ keys[start:end].float().T).view(hkv, group, rows, n)
        mine = torch.repeat_interleave(heads, row_lengths) == heads[:, None]  # [Hkv, n] slot in the head's run
        allowed = mine[:, None, None, :] & queries.allowed(positions[start:end].view(1, 1, n))[0, 0]
        if rect is not None:
            logits = torch.cat([logits, torch.einsum("hgrd,htd->hgrt", q[b], rect_keys[b].float())], -1)
            allowed = torch.cat([allowed.expand(hkv, 1, rows, n), rect_allowed[b][:, None]], -1)
        if queries.softcap is not None:
            logits = torch.tanh(logits / queries.softcap) * queries.softcap
        logits.masked_fill_(~allowed, float("-inf"))
        m = logits.amax(-1) if logits.shape[-1] else logits.new_full((hkv, group, rows), float("-inf"))
        # an empty or fully masked run has m = -inf: clamped, its exps are exp(-inf) = 0 (state stays empty)
        p = torch.exp(logits.sub_(m.clamp(min=torch.finfo(torch.float32).min)[..., None]))
        acc = (p[..., :n].reshape(-1, n) @ values[start:end].float()).view(hkv, group, rows, -1)
        if rect is not None:
            acc = acc + torch.einsum("hgrt,htd->hgrd", p[..., n:], rect_values[b].float())
        states.append((m, p.sum(-1), acc))
    return tuple(torch.stack(parts) for parts in zip(*states))


def sparse_attention(queries: Queries, keys, values, positions, selection: Selection,
                     use_triton: bool | None = None) -> torch.Tensor:
    """Output [B, Hq, q_len, D]."""
    return finish(sparse_attention_state(queries, keys, values, positions, selection, use_triton=use_triton),
                  queries)
