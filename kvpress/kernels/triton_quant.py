"""Triton kernel: attention over KIVI-packed keys/values, reading the codes directly.

Split-K (flash-decoding): program (b*h, s) covers a range of quantized slots in blocks of BLOCK_T. Each block
loads its codes as stored (contiguous bytes), splits them in registers into one plane per code position of a
byte, and contracts each plane with the matching dims of the query; a block inside one key group folds the
group's scale into the query and its min into one bias per row. An online softmax accumulates. The per-split
partials (max, sum, acc) are merged in torch into one state, which the layer folds with its other segments.
All query heads of a GQA group (x q_len rows) share one program, so each code is read once. On CPU the same
kernel runs under TRITON_INTERPRET=1 (tests); `lowbit_attention_state` uses it on CUDA for rectangular KIVI
codes.
"""

from __future__ import annotations

import os

import torch

from .online_softmax import by_row_blocks, merge_splits

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None


def available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def causal_allowed(pos, qpos, in_range, window, HAS_WINDOW: tl.constexpr):
        """[M_PAD, BLOCK] may query row (position qpos) read a slot at position pos."""
        allowed = (pos[None, :] <= qpos[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > qpos[:, None] - window)
        return allowed

    @triton.jit
    def softmax_step(m_i, l_i, logits):
        """Online softmax over one block of logits: (new max, new sum, probabilities, rescale of old acc)."""
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        corr = tl.exp(m_i - m_safe)
        return m_new, l_i * corr + tl.sum(p, 1), p, corr

    @triton.jit
    def store_partials(m_out, l_out, acc_out, bh, split, n_splits, m_i, l_i, acc, M_PAD: tl.constexpr,
                       D: tl.constexpr):
        rows = tl.arange(0, M_PAD)
        out = (bh * n_splits + split) * M_PAD
        tl.store(m_out + out + rows, m_i)
        tl.store(l_out + out + rows, l_i)
        tl.store(acc_out + (out + rows[:, None]) * D + tl.arange(0, D)[None, :], acc)

    @triton.jit
    def matmul(a, b, USE_DOT: tl.constexpr):
        """a [M, K] @ b [K, N] in fp32. tl.dot needs every side >= 16 on a GPU; a code plane of a small head
        (head_dim 32 at 2 bits: 8 dims) is narrower, and goes through a broadcast product summed over K."""
        if USE_DOT:
            return tl.dot(a, b)
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)

    @triton.jit
    def code_plane(codes, j: tl.constexpr, BITS: tl.constexpr, UPPER4: tl.constexpr):
        """Codes of position j within each byte, as floats; UPPER4 (the 4-bit draft view of 8-bit codes): the
        upper nibble alone (its scale x16 and min + 7.5 scale come from `plane_scale`)."""
        plane = ((codes >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        if UPPER4:
            plane = tl.floor(plane / 16.0)
        return plane

    @triton.jit
    def plane_scale(scale, low, UPPER4: tl.constexpr):
        """(scale, min) that turn `code_plane`'s values into dequantized ones."""
        if UPPER4:  # middle of the 16-code bucket: scale * (16 u + 7.5) + min
            return scale * 16.0, low + scale * 7.5
        return scale, low

    @triton.jit
    def query_plane(q_ptr, q_row, row_ok, cols, j: tl.constexpr, PER: tl.constexpr, D: tl.constexpr):
        """fp32 [M_PAD, D/PER]: the query's dims j, j+PER, ... (those that code position j of a byte holds)."""
        dims = cols * PER + j
        return tl.load(q_ptr + q_row[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def key_plane_logits(q, kbytes, ks_ptr, km_ptr, gid, t_ok, cols, logits, bias,
                         j: tl.constexpr, PER: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                         FOLD: tl.constexpr, UPPER4: tl.constexpr, DTYPE: tl.constexpr, WIDE: tl.constexpr):
        """Add code position j's share of the logits: `query_plane` j against that plane of the codes.
        FOLD: every slot of the block shares one key group (gid a scalar), so its per-channel scale multiplies
        the query (M x D/PER) instead of the codes and its min becomes one bias per row; else gid is per slot."""
        dims = cols * PER + j
        plane = code_plane(kbytes, j, BITS, UPPER4)
        if FOLD:
            scale, low = plane_scale(tl.load(ks_ptr + gid * D + dims).to(tl.float32),
                                     tl.load(km_ptr + gid * D + dims).to(tl.float32), UPPER4)
            logits += matmul((q * scale[None, :]).to(DTYPE), tl.trans(plane.to(DTYPE)), WIDE)
            bias += tl.sum(q * low[None, :], 1)
        else:
            off = gid[:, None] * D + dims[None, :]
            scale, low = plane_scale(tl.load(ks_ptr + off, mask=t_ok[:, None], other=0.0).to(tl.float32),
                                     tl.load(km_ptr + off, mask=t_ok[:, None], other=0.0).to(tl.float32), UPPER4)
            logits += matmul(q.to(DTYPE), tl.trans((plane * scale + low).to(DTYPE)), WIDE)
        return logits, bias

    @triton.jit
    def store_plane(acc_out, out_row, acc, cols, j: tl.constexpr, PER: tl.constexpr, D: tl.constexpr):
        tl.store(acc_out + out_row[:, None] * D + (cols * PER + j)[None, :], acc)

    @triton.jit
    def _quant_attn_kernel(
        q_ptr, kc_ptr, ks_ptr, km_ptr, kg_ptr, vc_ptr, vs_ptr, vm_ptr, pos_ptr, valid_ptr, qpos_ptr,
        m_out, l_out, acc_out,
        T_Q, T_ALL, N_GROUPS, SPLIT_LEN, N_SPLITS, scaling, window,
        M: tl.constexpr, M_PAD: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
        G: tl.constexpr, BLOCK_T: tl.constexpr, HAS_GROUP: tl.constexpr, HAS_VALID: tl.constexpr,
        HAS_WINDOW: tl.constexpr, UPPER4: tl.constexpr, FOLD: tl.constexpr,
    ):
        """The codes are read as stored: one contiguous [BLOCK_T, D/PER] byte tile per block (wide loads), split
        in registers into PER planes (code position j of each byte = dims j, j+PER, ...); each plane meets the
        matching dims of q and has its own accumulator, written back to its dims at the end. (Unpacking each
        dim from its byte instead costs one narrow load per element: 5% of the copy bandwidth on an H100.)"""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        NGV: tl.constexpr = D // G
        DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        WIDE: tl.constexpr = DB >= 16  # planes wide enough for tl.dot

        rows = tl.arange(0, M_PAD)
        cols = tl.arange(0, DB)
        row_ok = rows < M
        q_row = bh * M + rows
        qpos = tl.load(qpos_ptr + rows % R, mask=row_ok, other=0)
        ks_base = ks_ptr + bh * N_GROUPS * D
        km_base = km_ptr + bh * N_GROUPS * D

        q0 = query_plane(q_ptr, q_row, row_ok, cols, 0, PER, D)
        q1 = q0  # placeholders where a byte holds fewer code positions
        q2 = q0
        q3 = q0
        if PER > 1:
            q1 = query_plane(q_ptr, q_row, row_ok, cols, 1, PER, D)
        if PER > 2:
            q2 = query_plane(q_ptr, q_row, row_ok, cols, 2, PER, D)
            q3 = query_plane(q_ptr, q_row, row_ok, cols, 3, PER, D)

        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc0 = tl.zeros([M_PAD, DB], tl.float32)
        acc1 = tl.zeros([M_PAD, DB], tl.float32)
        acc2 = tl.zeros([M_PAD, DB], tl.float32)
        acc3 = tl.zeros([M_PAD, DB], tl.float32)

        start = split * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, T_Q)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < end
            tile = bh * T_Q * DB + t[:, None] * DB + cols[None, :]
            kbytes = tl.load(kc_ptr + tile, mask=t_ok[:, None], other=0)
            if FOLD:
                gid = t0 // G
            elif HAS_GROUP:
                gid = tl.load(kg_ptr + bh * T_Q + t, mask=t_ok, other=0)
            else:
                gid = t // G
            logits = tl.zeros([M_PAD, BLOCK_T], tl.float32)
            bias = tl.zeros([M_PAD], tl.float32)
            logits, bias = key_plane_logits(q0, kbytes, ks_base, km_base, gid, t_ok, cols, logits, bias,
                                            0, PER, D, BITS, FOLD, UPPER4, DTYPE, WIDE)
            if PER > 1:
                logits, bias = key_plane_logits(q1, kbytes, ks_base, km_base, gid, t_ok, cols, logits,
                                                bias, 1, PER, D, BITS, FOLD, UPPER4, DTYPE, WIDE)
            if PER > 2:
                logits, bias = key_plane_logits(q2, kbytes, ks_base, km_base, gid, t_ok, cols, logits,
                                                bias, 2, PER, D, BITS, FOLD, UPPER4, DTYPE, WIDE)
                logits, bias = key_plane_logits(q3, kbytes, ks_base, km_base, gid, t_ok, cols, logits,
                                                bias, 3, PER, D, BITS, FOLD, UPPER4, DTYPE, WIDE)
            logits = (logits + bias[:, None]) * scaling  # [M_PAD, BLOCK_T]

            pos = tl.load(pos_ptr + bh * T_ALL + t, mask=t_ok, other=0)
            allowed = causal_allowed(pos, qpos, t_ok, window, HAS_WINDOW)
            if HAS_VALID:
                ok = tl.load(valid_ptr + bh * T_ALL + t, mask=t_ok, other=0)
                allowed = allowed & (ok[None, :] != 0)
            allowed = allowed | ((pos[None, :] == qpos[:, None]) & t_ok[None, :])
            m_new, l_i, p, corr = softmax_step(m_i, l_i, tl.where(allowed, logits, float("-inf")))
            p = p.to(DTYPE)

            # values: per slot, per group of G channels: the slot's NGV scales spread over the plane's columns
            # (column c of every plane holds a dim of channel group c // (G / PER))
            vbytes = tl.load(vc_ptr + tile, mask=t_ok[:, None], other=0)
            voff = bh * T_Q * NGV + t[:, None] * NGV + (cols // (DB // NGV))[None, :]
            vscale = tl.load(vs_ptr + voff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            vmin = tl.load(vm_ptr + voff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            vscale, vmin = plane_scale(vscale, vmin, UPPER4)
            acc0 = acc0 * corr[:, None] + matmul(
                p, (code_plane(vbytes, 0, BITS, UPPER4) * vscale + vmin).to(DTYPE), WIDE)
            if PER > 1:
                acc1 = acc1 * corr[:, None] + matmul(
                    p, (code_plane(vbytes, 1, BITS, UPPER4) * vscale + vmin).to(DTYPE), WIDE)
            if PER > 2:
                acc2 = acc2 * corr[:, None] + matmul(
                    p, (code_plane(vbytes, 2, BITS, UPPER4) * vscale + vmin).to(DTYPE), WIDE)
                acc3 = acc3 * corr[:, None] + matmul(
                    p, (code_plane(vbytes, 3, BITS, UPPER4) * vscale + vmin).to(DTYPE), WIDE)
            m_i = m_new

        out = (bh * N_SPLITS + split) * M_PAD
        tl.store(m_out + out + rows, m_i)
        tl.store(l_out + out + rows, l_i)
        store_plane(acc_out, out + rows, acc0, cols, 0, PER, D)
        if PER > 1:
            store_plane(acc_out, out + rows, acc1, cols, 1, PER, D)
        if PER > 2:
            store_plane(acc_out, out + rows, acc2, cols, 2, PER, D)
            store_plane(acc_out, out + rows, acc3, cols, 3, PER, D)


# Query rows (GQA group x positions) one program holds: its accumulator [M_PAD, D] fp32 and the [M_PAD, BLOCK_T]
# logits must fit in one SM's registers and shared memory (a chunked prefill's 256-row block of a group of 4 asked
# an H100 for 337 KB of shared memory against 227 KB). Longer calls run in row blocks.
MAX_PROGRAM_ROWS = 64


def rows_per_call(group: int) -> int:
    return max(1, MAX_PROGRAM_ROWS // group)


def plan_splits(n: int, programs: int, block_t: int, target_programs: int) -> tuple[int, int]:
    """Split-K plan: (number of splits, slots per split, a multiple of block_t) so that about
    target_programs programs run when `programs` (b*h) programs already cover the other axis."""
    splits = max(1, min(triton.cdiv(n, block_t), triton.cdiv(target_programs, programs)))
    split_len = triton.cdiv(triton.cdiv(n, splits), block_t) * block_t
    return triton.cdiv(n, split_len), split_len


def partial_buffers(programs: int, splits: int, m_pad: int, dim: int, device):
    m = torch.empty(programs, splits, m_pad, device=device, dtype=torch.float32)
    return m, torch.empty_like(m), torch.empty(programs, splits, m_pad, dim, device=device, dtype=torch.float32)


def lowbit_attention_state_triton(queries, codes, positions, valid=None, precision=None, block_t: int = 64,
                                  target_programs: int = 512):
    """Online-softmax state over rectangular low-bit codes [B, Hkv, T], as `lowbit_attention_state_reference`."""
    if queries.softcap is not None:
        raise ValueError("softcap is not supported by the Triton low-bit kernel; use the reference")
    if precision not in (None, codes.bits) and not (codes.bits == 8 and precision == 4):
        raise ValueError(f"precision={precision}; allowed values: None, or 4 on an 8-bit segment")
    query = queries.values
    batch, hq, rows, dim = query.shape
    hkv = codes.k_codes.shape[1]
    g = hq // hkv
    if rows > rows_per_call(g):
        return by_row_blocks(queries, rows_per_call(g), lambda part: lowbit_attention_state_triton(
            part, codes, positions, valid, precision, block_t, target_programs))
    m_rows = g * rows
    m_pad = max(16, triton.next_power_of_2(m_rows))
    n_q = codes.num_slots
    q = query.reshape(batch * hkv, m_rows, dim).contiguous()
    splits, split_len = plan_splits(n_q, batch * hkv, block_t, target_programs)
    m_part, l_part, acc_part = partial_buffers(batch * hkv, splits, m_pad, dim, query.device)
    positions = positions.to(torch.int32).contiguous()
    valid_arg = positions if valid is None else valid.to(torch.int8).contiguous()
    groups = codes.k_group
    _quant_attn_kernel[(batch * hkv, splits)](
        q, codes.k_codes.contiguous(), codes.k_scale.contiguous(), codes.k_min.contiguous(),
        positions if groups is None else groups.to(torch.int32).contiguous(),
        codes.v_codes.contiguous(), codes.v_scale.contiguous(), codes.v_min.contiguous(),
        positions, valid_arg, queries.positions.to(torch.int32).contiguous(),
        m_part, l_part, acc_part,
        n_q, n_q, codes.k_scale.shape[2], split_len, splits, float(queries.scaling),
        int(queries.sliding_window or 0),
        M=m_rows, M_PAD=m_pad, R=rows, D=dim, BITS=codes.bits, G=codes.group_size, BLOCK_T=block_t,
        HAS_GROUP=groups is not None, HAS_VALID=valid is not None, HAS_WINDOW=queries.sliding_window is not None,
        UPPER4=precision == 4 and codes.bits == 8, FOLD=groups is None and codes.group_size % block_t == 0,
    )
    return merge_splits(m_part, l_part, acc_part, (batch, hkv, g, rows), dim)
