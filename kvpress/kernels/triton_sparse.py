"""Triton kernel: attention over gathered slot indices, loading K/V rows straight from the cache.

Split-K over the index list; program (b*h, s) loads BLOCK_T indices, then their key/value rows, and keeps an
online softmax; partials are merged in torch. Same signature as `sparse_attention_state_reference`.
"""

from __future__ import annotations

import torch

from .online_softmax import by_row_blocks, merge_splits
from .triton_quant import available, partial_buffers, plan_splits, rows_per_call, triton

if triton is not None:
    import triton.language as tl

    from .triton_quant import causal_allowed, softmax_step, store_partials

    @triton.jit
    def _sparse_attn_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, ok_ptr, pos_ptr, qpos_ptr, m_out, l_out, acc_out,
        KV_BH_STRIDE, POS_BH_STRIDE, K, SPLIT_LEN, N_SPLITS, scaling, window,
        M: tl.constexpr, M_PAD: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_OK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, M_PAD)
        dims = tl.arange(0, D)
        row_ok = rows < M
        q = tl.load(q_ptr + bh * M * D + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        qpos = tl.load(qpos_ptr + rows % R, mask=row_ok, other=0)
        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D], tl.float32)
        start = split * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, K)
        for t0 in range(start, end, BLOCK_T):
            j = t0 + tl.arange(0, BLOCK_T)
            j_ok = j < end
            slot = tl.load(idx_ptr + bh * K + j, mask=j_ok, other=0)
            k = tl.load(k_ptr + bh * KV_BH_STRIDE + slot[:, None] * D + dims[None, :], mask=j_ok[:, None], other=0.0)
            logits = tl.dot(q, tl.trans(k)) * scaling
            pos = tl.load(pos_ptr + bh * POS_BH_STRIDE + slot, mask=j_ok, other=0)
            allowed = causal_allowed(pos, qpos, j_ok, window, HAS_WINDOW)
            allowed = allowed | ((pos[None, :] == qpos[:, None]) & j_ok[None, :])
            if HAS_OK:  # after the self rule: padded index entries may repeat the current slot
                ok = tl.load(ok_ptr + bh * K + j, mask=j_ok, other=0)
                allowed = allowed & (ok[None, :] != 0)
            m_new, l_i, p, corr = softmax_step(m_i, l_i, tl.where(allowed, logits, float("-inf")))
            v = tl.load(v_ptr + bh * KV_BH_STRIDE + slot[:, None] * D + dims[None, :], mask=j_ok[:, None], other=0.0)
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        store_partials(m_out, l_out, acc_out, bh, split, N_SPLITS, m_i, l_i, acc, M_PAD, D)


def sparse_attention_state_triton(queries, keys, values, positions, selection, block_t: int = 64,
                                  target_programs: int = 512):
    """Online-softmax state over the selected slots, as `sparse_attention_state_reference`. keys/values are
    [B, Hkv, T, D], or one flat store [N, D] shared by every (row, head) with positions [N] (flat storage
    segments: indices are then absolute slot numbers into the store)."""
    if queries.softcap is not None:
        raise ValueError("softcap is not supported by the Triton sparse kernel; use the reference")
    assert available()
    query = queries.values
    batch, hq, rows, dim = query.shape
    indices = selection.indices
    hkv = indices.shape[1]
    flat = keys.dim() == 2
    kv_stride, pos_stride = (0, 0) if flat else (keys.shape[2] * dim, keys.shape[2])
    g = hq // hkv
    if rows > rows_per_call(g):
        return by_row_blocks(queries, rows_per_call(g), lambda part: sparse_attention_state_triton(
            part, keys, values, positions, selection, block_t, target_programs))
    m_rows = g * rows
    m_pad = max(16, triton.next_power_of_2(m_rows))
    n_idx = indices.shape[-1]
    splits, split_len = plan_splits(n_idx, batch * hkv, block_t, target_programs)
    m_part, l_part, acc_part = partial_buffers(batch * hkv, splits, m_pad, dim, query.device)
    idx = indices.to(torch.int32).contiguous()
    ok = idx if selection.valid is None else selection.valid.to(torch.int8).contiguous()
    _sparse_attn_kernel[(batch * hkv, splits)](
        query.reshape(batch * hkv, m_rows, dim).contiguous(), keys.contiguous(), values.contiguous(), idx, ok,
        positions.to(torch.int32).contiguous(), queries.positions.to(torch.int32).contiguous(),
        m_part, l_part, acc_part, kv_stride, pos_stride, n_idx, split_len, splits, float(queries.scaling),
        int(queries.sliding_window or 0),
        M=m_rows, M_PAD=m_pad, R=rows, D=dim, BLOCK_T=block_t, HAS_OK=selection.valid is not None,
        HAS_WINDOW=queries.sliding_window is not None,
    )
    return merge_splits(m_part, l_part, acc_part, (batch, hkv, g, rows), dim)
