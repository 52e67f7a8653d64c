"""Attention over low-bit storage (KIVI / GEAR codes), read block by block: no full-precision copy of the codes
is ever made. Any q_len works (decode, verification, chunked prefill). Each function returns the online-softmax
state over the codes' slots, so the layer folds it with its full-precision segments.

`lowbit_attention_state` (rectangular codes [B, Hkv, T]) dispatches: the Triton kernel on CUDA for KIVI codes;
on CPU the C kernel of lowbit_native.py for KIVI or GEAR codes, in slot order or gathered by an eviction (with
the layer's full-precision tail in the same call), `codes_domain_attention_state` under torch.compile or where
the C kernel could not be built (the same computation in torch: the scales are folded into the queries and the
probabilities, the codes unpacked into contiguous planes and never rescaled, GEAR's terms added as corrections),
and the torch reference for the rest (the draft's reduced precision; codes reordered by eviction where the C
kernel does not run).
`flat_lowbit_attention_state` reads a flat store of per-head runs (codes [1, 1, N] of a flat segment: a
left-padded batch whose padding cuts key groups): on CPU through the same C kernel, each run in place; elsewhere
through its torch reference, which dequantizes each block of the store once and lets every (row, head) read its
part of the block through the sparse-gather path (no Triton kernel for flat codes yet).
"""

from __future__ import annotations

import torch

from ..formats.lowbit import LowBitCodes
from . import lowbit_native
from .online_softmax import Queries, State, block_update, dense_attention_state, empty_state, merge_states
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


def code_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 [8/bits, *packed.shape]: plane i holds code i of every byte (channel j * 8/bits + i of byte j). Each
    plane is one contiguous conversion of the packed bytes: no interleaved writes, which cost several times a
    contiguous one on CPU."""
    per_byte, field = 8 // bits, (1 << bits) - 1
    out = torch.empty(per_byte, *packed.shape, dtype=torch.float32, device=packed.device)
    for i in range(per_byte):
        shifted = packed >> (bits * i) if i else packed
        out[i].copy_(shifted & field if i < per_byte - 1 else shifted)
    return out


def _codes_at(packed: torch.Tensor, bits: int, slot: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """fp32 code of (slot, channel) entries [B, H, N] of packed codes [B, H, T, J]."""
    per_byte = 8 // bits
    flat = packed.flatten(2).gather(2, slot * packed.shape[-1] + channel // per_byte)
    return ((flat >> (bits * (channel % per_byte)).to(torch.uint8)) & ((1 << bits) - 1)).float()


def codes_domain_attention_state(queries: Queries, codes: LowBitCodes, positions, valid=None,
                                 state: State | None = None, block: int = 4096) -> State:
    """The reference's result for codes whose key groups are implicit (slot // group_size), KIVI's or GEAR's,
    without ever building full-precision keys or values: scales are folded into the queries (keys: per group of
    slots and channel) and into the probabilities (values: per slot and channel group), the codes are unpacked
    into planes (`code_planes`), one per code position in a byte, each contracted by one matmul; `block` slots
    at a time bound the planes' memory. GEAR's terms enter as corrections: the low-rank part through
    (query @ basis) and (probabilities @ row factors), each exact outlier as the difference it makes to its one
    logit or output channel."""
    hkv = codes.k_codes.shape[1]
    q = queries.grouped(hkv)
    batch, _, group, rows, dim = q.shape
    state = empty_state(q) if state is None else state
    length, g, bits = codes.num_slots, codes.group_size, codes.bits
    if length == 0:
        return state
    n_rows, n_groups = group * rows, length // g
    per_byte = 8 // bits
    qr = q.reshape(batch, hkv, n_rows, dim)
    # keys: logits[t] = sum_d q_d scale[t // g, d] code[t, d] + sum_d q_d min[t // g, d]
    k_scale, k_min = codes.k_scale.float(), codes.k_min.float()  # [B, H, n_groups, D]
    weights = (qr[:, :, None] * k_scale[:, :, :, None]).unflatten(-1, (-1, per_byte)).movedim(-1, 0).contiguous()
    logits = (k_min @ qr.transpose(-1, -2))[..., None].repeat(1, 1, 1, 1, g)  # [B, H, n, R, g]
    block = max(g, block // g * g)  # whole key groups
    for start in range(0, length, block):
        end = min(length, start + block)
        planes = code_planes(codes.k_codes[:, :, start:end], bits).unflatten(3, (-1, g))  # [per_byte,B,H,n',g,J]
        groups = slice(start // g, end // g)
        logits[:, :, groups] += (weights[:, :, :, groups] @ planes.transpose(-1, -2)).sum(0)
    logits = logits.transpose(2, 3).reshape(batch, hkv, n_rows, length)  # [B, H, R, T]
    if codes.k_lr is not None:
        logits = logits + _gear_key_terms(qr, codes)
    logits = logits * queries.scaling
    if queries.softcap is not None:
        logits = torch.tanh(logits / queries.softcap) * queries.softcap
    logits = logits.masked_fill(~queries.allowed_by_row(positions, valid, group), float("-inf"))
    m = logits.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - safe[..., None])  # [B, H, R, T]
    # values: out[d] = sum_t p_t scale[t, d // g] code[t, d] + sum_t p_t min[t, d // g]. Every channel group's
    # scaled probabilities read every byte in one matmul (memory-bound: the extra rows cost little); each group
    # then takes its own columns.
    v_scale = codes.v_scale.transpose(2, 3).float().contiguous()  # [B, H, C, T] (a strided one costs 10x here)
    n_chan = v_scale.shape[2]
    scaled = (p[:, :, None] * v_scale[:, :, :, None]).flatten(2, 3)  # [B, H, C*R, T]
    per_group = 0
    for start in range(0, length, block):
        end = min(length, start + block)
        per_group = per_group + scaled[..., start:end] @ code_planes(codes.v_codes[:, :, start:end], bits)
    per_group = per_group.unflatten(3, (n_chan, n_rows)).unflatten(-1, (n_chan, -1))  # [.., C, R, C, J/C]
    own = per_group.diagonal(dim1=3, dim2=5)  # [per_byte, B, H, R, J/C, C]
    acc = own.permute(1, 2, 3, 5, 4, 0).reshape(batch, hkv, n_rows, dim)  # channel (c * J/C + j) * per_byte + i
    acc = acc + (p @ codes.v_min.float()).repeat_interleave(dim // n_chan, -1)
    if codes.v_lr is not None:
        acc = acc + _gear_value_terms(p, codes)
    part = (m.view(batch, hkv, group, rows), p.sum(-1).view(batch, hkv, group, rows),
            acc.view(batch, hkv, group, rows, dim))
    return merge_states(state, part)


def _gear_key_terms(qr: torch.Tensor, codes: LowBitCodes) -> torch.Tensor:
    """[B, H, R, T]: what GEAR's low-rank term and exact key outliers add to q . dequantized codes."""
    batch, hkv, n_rows, dim = qr.shape
    basis = codes.k_basis.float()  # [B, H, Nc, D, r]
    n_chunks, rank = basis.shape[2], basis.shape[-1]
    # every slot's row factor against every chunk's (query @ basis), then each slot takes its own chunk's rows
    q_basis = (qr[:, :, None] @ basis).transpose(2, 3).reshape(batch, hkv, n_rows * n_chunks, rank)
    every = codes.k_lr.float() @ q_basis.transpose(-1, -2)  # [B, H, T, R * Nc]
    own = codes.chunk.long()[..., None] + n_chunks * torch.arange(n_rows, device=qr.device)
    terms = every.gather(3, own).transpose(2, 3)  # [B, H, R, T]
    slot = codes.k_out_slot.long()  # [B, H, N]; -1 once evicted
    if slot.shape[-1]:
        live, slot = slot >= 0, slot.clamp(min=0)
        chan = codes.k_out_chan.long()
        at = slot // codes.group_size * dim + chan  # the entry's (key group, channel)
        approx = (_codes_at(codes.k_codes, codes.bits, slot, chan) * codes.k_scale.flatten(2).gather(2, at).float()
                  + codes.k_min.flatten(2).gather(2, at).float()
                  + _low_rank_at(codes.k_lr, codes.k_basis, codes.chunk, slot, chan))
        delta = (codes.k_out_val.float() - approx) * live  # the outlier replaces the approximation
        q_chan = qr.gather(3, chan[:, :, None].expand(-1, -1, n_rows, -1))  # [B, H, R, N]
        terms = terms.scatter_add(3, slot[:, :, None].expand(-1, -1, n_rows, -1), q_chan * delta[:, :, None])
    return terms


def _gear_value_terms(p: torch.Tensor, codes: LowBitCodes) -> torch.Tensor:
    """[B, H, R, D]: what GEAR's low-rank term and exact value outliers add to p @ dequantized codes."""
    batch, hkv, n_rows, length = p.shape
    basis = codes.v_basis.float()  # [B, H, Nc, D, r]
    rank = basis.shape[-1]
    one_hot = (codes.chunk[..., None] == torch.arange(basis.shape[2], device=p.device)).float()  # [B, H, T, Nc]
    weighted = p[..., None] * codes.v_lr.float()[:, :, None]  # [B, H, R, T, r]
    per_chunk = one_hot.transpose(-1, -2)[:, :, None] @ weighted  # [B, H, R, Nc, r]
    terms = torch.einsum("bhrcs,bhcds->bhrd", per_chunk, basis)
    idx = codes.v_out_idx.long()  # [B, H, T, n_out]
    if idx.shape[-1]:
        dim, n_out = basis.shape[3], idx.shape[-1]
        slot = torch.arange(length, device=p.device)[:, None].expand(length, n_out).expand(batch, hkv, -1, -1)
        flat_slot, flat_chan = slot.flatten(2), idx.flatten(2)
        n_chan = codes.v_scale.shape[-1]
        at = flat_slot * n_chan + flat_chan // (dim // n_chan)
        approx = (_codes_at(codes.v_codes, codes.bits, flat_slot, flat_chan)
                  * codes.v_scale.flatten(2).gather(2, at).float() + codes.v_min.flatten(2).gather(2, at).float()
                  + _low_rank_at(codes.v_lr, codes.v_basis, codes.chunk, flat_slot, flat_chan))
        delta = codes.v_out_val.float().flatten(2) - approx  # [B, H, T * n_out]
        src = p.repeat_interleave(n_out, -1) * delta[:, :, None]  # [B, H, R, T * n_out]
        terms = terms.scatter_add(3, flat_chan[:, :, None].expand(-1, -1, n_rows, -1), src)
    return terms


def _low_rank_at(lr: torch.Tensor, basis: torch.Tensor, chunk: torch.Tensor, slot: torch.Tensor,
                 channel: torch.Tensor) -> torch.Tensor:
    """fp32 low-rank term lr[slot] . basis[chunk[slot], channel] of entries [B, H, N]."""
    rank, dim = basis.shape[-1], basis.shape[-2]
    rows = lr.gather(2, slot[..., None].expand(-1, -1, -1, rank))  # [B, H, N, r]
    which = chunk.gather(2, slot) * dim + channel  # row of basis.flatten(2, 3)
    cols = basis.flatten(2, 3).gather(2, which[..., None].expand(-1, -1, -1, rank))
    return (rows.float() * cols.float()).sum(-1)


def lowbit_attention_state(queries: Queries, codes: LowBitCodes, positions, valid=None, state: State | None = None,
                           precision: int | None = None, use_triton: bool | None = None,
                           tail: tuple | None = None) -> State:
    """`tail`: (keys, values, positions, valid) of a full-precision rectangle read after the codes (the layer's
    newest tokens): the CPU kernel reads it in the same call, the other paths after the codes."""
    from . import triton_quant  # imports triton where installed: only once a low-bit read may run on it

    native = use_triton is not True and precision in (None, codes.bits) and lowbit_native.supports(queries, codes)
    if native:
        return lowbit_native.lowbit_attention_state_native(queries, codes, positions, valid, state, tail)
    if tail is not None:
        state = lowbit_attention_state(queries, codes, positions, valid, state, precision, use_triton)
        return dense_attention_state(queries, *tail, state)
    if use_triton is None:
        use_triton = (queries.values.is_cuda and triton_quant.available() and codes.k_lr is None
                      and queries.softcap is None)
    if not use_triton:
        if (codes.k_group is None and precision in (None, codes.bits) and codes.num_slots % codes.group_size == 0
                and codes.group_size % (8 // codes.bits) == 0):
            return codes_domain_attention_state(queries, codes, positions, valid, state)
        return lowbit_attention_state_reference(queries, codes, positions, valid, state, precision)
    part = triton_quant.lowbit_attention_state_triton(queries, codes, positions, valid, precision)
    return part if state is None else merge_states(state, part)


def flat_lowbit_attention_state(queries: Queries, codes: LowBitCodes, positions, lengths, state: State | None = None,
                                precision: int | None = None, block: int = 4096, tail: tuple | None = None) -> State:
    """codes/positions [1, 1, N]: one flat store, each (row, head) a contiguous run of `lengths` [B, Hkv] slots in
    (row, head) order; `tail`: (keys, values, positions, valid) of full-precision rectangular slots read with
    them. On CPU, lowbit_cpu.c reads each run in place (and the tail in the same call); elsewhere (and as its
    reference) blocks of the store are dequantized and each run's part gathered."""
    if precision in (None, codes.bits) and lowbit_native.supports(queries, codes):
        return lowbit_native.flat_lowbit_attention_state_native(queries, codes, positions, lengths, state, tail)
    state = flat_lowbit_attention_state_reference(queries, codes, positions, lengths, state, precision, block)
    return state if tail is None else dense_attention_state(queries, *tail, state)


def flat_lowbit_attention_state_reference(queries: Queries, codes: LowBitCodes, positions, lengths,
                                          state: State | None = None, precision: int | None = None,
                                          block: int = 4096) -> State:
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
        if torch.compiler.is_compiling():
            width = hi - lo  # a traced step keeps its shapes: the block's width bounds every run's part (ok masks it)
        else:
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
