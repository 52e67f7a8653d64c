"""Triton kernel: attention over KIVI-packed keys/values, reading the codes directly.

Split-K (flash-decoding): program (b*h, s) covers a range of quantized slots in blocks of BLOCK_T. Each block
unpacks the uint8 codes in registers, applies the per-group scale/min, and feeds tl.dot; an online softmax
accumulates. The per-split partials (max, sum, acc) are merged in torch into one state, which the layer folds
with its other segments. All query heads of a GQA group (x q_len rows) share one program, so each code is
read once. On CPU the same kernel runs under TRITON_INTERPRET=1 (tests); `lowbit_attention_state` uses it on
CUDA for rectangular KIVI codes.
"""

from __future__ import annotations

import os

import torch

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
    def _quant_attn_kernel(
        q_ptr, kc_ptr, ks_ptr, km_ptr, kg_ptr, vc_ptr, vs_ptr, vm_ptr, pos_ptr, valid_ptr, qpos_ptr,
        m_out, l_out, acc_out,
        T_Q, T_ALL, N_GROUPS, SPLIT_LEN, N_SPLITS, scaling, window,
        M: tl.constexpr, M_PAD: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
        G: tl.constexpr, BLOCK_T: tl.constexpr, HAS_GROUP: tl.constexpr, HAS_VALID: tl.constexpr,
        HAS_WINDOW: tl.constexpr, UPPER4: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        NGV: tl.constexpr = D // G
        MASK: tl.constexpr = (1 << BITS) - 1

        rows = tl.arange(0, M_PAD)
        dims = tl.arange(0, D)
        row_ok = rows < M
        q = tl.load(q_ptr + bh * M * D + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        qpos = tl.load(qpos_ptr + rows % R, mask=row_ok, other=0)

        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D], tl.float32)
        byte_of = dims // PER
        shift = ((dims % PER) * BITS).to(tl.uint8)

        start = split * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, T_Q)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < end
            # keys: unpack codes, per-channel scale/min of each slot's group
            kbytes = tl.load(kc_ptr + bh * T_Q * DB + t[:, None] * DB + byte_of[None, :], mask=t_ok[:, None], other=0)
            kcode = ((kbytes >> shift[None, :]) & MASK).to(tl.float32)
            if UPPER4:  # draft view of an 8-bit code: upper nibble, middle of its bucket
                kcode = tl.floor(kcode / 16.0) * 16.0 + 7.5
            if HAS_GROUP:
                gid = tl.load(kg_ptr + bh * T_Q + t, mask=t_ok, other=0)
            else:
                gid = t // G
            goff = bh * N_GROUPS * D + gid[:, None] * D + dims[None, :]
            kscale = tl.load(ks_ptr + goff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            kmin = tl.load(km_ptr + goff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            k = (kcode * kscale + kmin).to(q.dtype)
            logits = tl.dot(q, tl.trans(k)) * scaling  # [M_PAD, BLOCK_T]

            pos = tl.load(pos_ptr + bh * T_ALL + t, mask=t_ok, other=0)
            allowed = causal_allowed(pos, qpos, t_ok, window, HAS_WINDOW)
            if HAS_VALID:
                ok = tl.load(valid_ptr + bh * T_ALL + t, mask=t_ok, other=0)
                allowed = allowed & (ok[None, :] != 0)
            allowed = allowed | ((pos[None, :] == qpos[:, None]) & t_ok[None, :])
            m_new, l_i, p, corr = softmax_step(m_i, l_i, tl.where(allowed, logits, float("-inf")))

            # values: unpack codes, per-slot scale/min of each channel group
            vbytes = tl.load(vc_ptr + bh * T_Q * DB + t[:, None] * DB + byte_of[None, :], mask=t_ok[:, None], other=0)
            vcode = ((vbytes >> shift[None, :]) & MASK).to(tl.float32)
            if UPPER4:
                vcode = tl.floor(vcode / 16.0) * 16.0 + 7.5
            voff = bh * T_Q * NGV + t[:, None] * NGV + (dims // G)[None, :]
            vscale = tl.load(vs_ptr + voff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            vmin = tl.load(vm_ptr + voff, mask=t_ok[:, None], other=0.0).to(tl.float32)
            v = (vcode * vscale + vmin).to(q.dtype)
            acc = acc * corr[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        store_partials(m_out, l_out, acc_out, bh, split, N_SPLITS, m_i, l_i, acc, M_PAD, D)


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
    from .online_softmax import by_row_blocks, merge_splits

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
        UPPER4=precision == 4 and codes.bits == 8,
    )
    return merge_splits(m_part, l_part, acc_part, (batch, hkv, g, rows), dim)
