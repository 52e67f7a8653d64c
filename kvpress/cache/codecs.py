"""Encoders of low-bit codes for the older slots of a layer: KIVI (asymmetric 2/4-bit, keys per channel, values per
token) and GEAR (KIVI + exact outliers + low-rank correction of the quantization error). The codes' layout, and
how they are read back, is kvpress/formats/lowbit.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..formats.lowbit import LowBitCodes, pack, quantize


def encode_kivi(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, bits: int, group_size: int,
                k_counts: torch.Tensor | None = None, v_counts: torch.Tensor | None = None):
    """Quantize n slots (n a multiple of group_size) of K/V [B, H, n, D]; `valid` [B, H, n] excludes padding
    and filler slots from the ranges; `k_counts`/`v_counts` [B, H, n, D] exclude single entries (outliers
    kept exactly elsewhere)."""
    batch, heads, n, dim = k.shape
    g = group_size
    kg = k.reshape(batch, heads, n // g, g, dim)
    kvalid = valid.reshape(batch, heads, n // g, g, 1)
    if k_counts is not None:
        kvalid = kvalid & k_counts.reshape(batch, heads, n // g, g, dim)
    k_codes, k_scale, k_min = quantize(kg, bits, dim=3, valid=kvalid)  # per channel over g slots
    vg = v.reshape(batch, heads, n, dim // g, g)
    vvalid = None if v_counts is None else v_counts.reshape(batch, heads, n, dim // g, g)
    v_codes, v_scale, v_min = quantize(vg, bits, dim=4, valid=vvalid)  # per slot over g channels
    return LowBitCodes(
        bits=bits, group_size=g,
        k_codes=pack(k_codes.reshape(batch, heads, n, dim), bits), k_scale=k_scale, k_min=k_min,
        v_codes=pack(v_codes.reshape(batch, heads, n, dim), bits), v_scale=v_scale, v_min=v_min,
    )


def _outliers(x: torch.Tensor, n_out: int, real: torch.Tensor | None = None, n_real: torch.Tensor | None = None):
    """Along the last dim: positions and values of the n_out largest and n_out smallest entries, and a mask
    that is False there (they are kept exactly, so they must not stretch their quantization group).
    With `real` (a mask like x: the real entries) fillers are never outliers, and each row takes only its own
    count `n_real` (<= n_out, shaped like x without its last dim): its other entries point at one of its fillers
    (it has some, being shorter) with value 0, so a row is encoded as it is alone."""
    if n_out == 0:
        return x.new_zeros(*x.shape[:-1], 0, dtype=torch.long), x.new_zeros(*x.shape[:-1], 0), None
    high, low = (x, -x) if real is None else (x.masked_fill(~real, float("-inf")), (-x).masked_fill(~real, float("-inf")))
    idx = torch.cat([high.topk(n_out, dim=-1).indices, low.topk(n_out, dim=-1).indices], -1)
    if n_real is not None:
        used = torch.arange(n_out, device=x.device).repeat(2) < n_real[..., None]
        idx = torch.where(used, idx, (~real).int().argmax(-1, keepdim=True))  # a filler of the row
    counts = torch.ones_like(x, dtype=torch.bool).scatter(-1, idx, False)
    values = x.gather(-1, idx)
    return idx, values if n_real is None else values.masked_fill(~used, 0.0), counts


def _low_rank(err: torch.Tensor, rank: int, iters: int, seed: int):
    """Rank-r power iteration per (row, head) in fp32: err [B, H, n, D] ~= a @ basis^T, a [B,H,n,r],
    basis [B,H,D,r]. Orthonormalised once, at the end."""
    batch, heads, n, dim = err.shape
    gen = torch.Generator(device=err.device).manual_seed(seed)
    # one start for every (row, head): a row's result does not depend on its place in the batch
    p = torch.randn(dim, rank, generator=gen, device=err.device).expand(batch, heads, dim, rank)
    for _ in range(iters):
        qb = err @ p
        p = err.transpose(-1, -2) @ qb
    qb, _ = torch.linalg.qr(err @ p)  # [B,H,n,r] orthonormal columns
    basis = err.transpose(-1, -2) @ qb  # [B,H,D,r]
    return qb, basis


def encode_gear(k, v, valid, bits, group_size, rank, outlier_ratio, power_iters, seed=0):
    """GEAR: X ~= deq(Q(X - S)) + low-rank, with the outliers S restored exactly. As in the reference, key
    outliers are the outlier_ratio/2 largest and smallest entries of each channel over the encoded slots,
    value outliers those of each slot row; counts are floored (a small group may have none)."""
    batch, heads, n, dim = k.shape
    mask = valid[..., None]
    k, v = k.float() * mask, v.float() * mask
    # keys: per channel, along the slots; a row with fillers counts its own real slots
    n_k = int(outlier_ratio * n / 2)
    real = n_real = None
    if not bool(valid.all()):
        real = valid[:, :, None, :].expand(batch, heads, dim, n)
        n_real = torch.floor(valid.sum(-1).double() * outlier_ratio / 2).long()[:, :, None].expand(batch, heads, dim)
    k_idx, k_val, k_counts = _outliers(k.transpose(2, 3), n_k, real, n_real)  # [B,H,D,2n_k]
    chan = torch.arange(dim, device=k.device)[:, None].expand(dim, 2 * n_k)
    chan_dtype = torch.uint8 if dim <= 256 else torch.int16
    # values: per slot row, along the channels
    n_v = int(outlier_ratio * dim / 2)
    v_idx, v_val, v_counts = _outliers(v, n_v)
    seg = encode_kivi(k, v, valid, bits, group_size,
                      None if k_counts is None else k_counts.transpose(2, 3), v_counts)
    zero_lr = torch.zeros(batch, heads, n, rank, device=k.device, dtype=torch.float16)
    zero_basis = torch.zeros(batch, heads, 1, dim, rank, device=k.device, dtype=torch.float16)
    probe = replace(
        seg,
        k_out_slot=k_idx.reshape(batch, heads, -1).to(torch.int32),
        k_out_chan=chan.reshape(-1).expand(batch, heads, -1).to(chan_dtype).contiguous(),
        k_out_val=k_val.reshape(batch, heads, -1).half(),
        v_out_idx=v_idx.to(chan_dtype), v_out_val=v_val.half(),
        k_lr=zero_lr, v_lr=zero_lr, k_basis=zero_basis, v_basis=zero_basis,
        chunk=torch.zeros(batch, heads, n, dtype=torch.int32, device=k.device),
    )
    # the error that quantization + outliers leave, corrected by a low-rank term
    k_hat, v_hat = probe.dequantize(0, n)
    k_a, k_b = _low_rank((k - k_hat) * mask, rank, power_iters, seed)
    v_a, v_b = _low_rank((v - v_hat) * mask, rank, power_iters, seed + 1)
    return replace(probe, k_lr=k_a.half(), v_lr=v_a.half(),
                   k_basis=k_b[:, :, None].half(), v_basis=v_b[:, :, None].half())
