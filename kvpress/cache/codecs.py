"""Low-bit storage for the older slots of a layer: KIVI (asymmetric 2/4-bit, keys per channel, values per
token) and GEAR (KIVI + exact outliers + low-rank correction of the quantization error).

Layout. Codes are bit-packed into uint8 along the channel axis, one row per token slot, so evicting slots is
a row gather. Keys are quantized per channel over groups of `group_size` consecutive slots (their fp16
scale/min live per group); values per token over groups of `group_size` channels. Key-group ids are implicit
(slot // group_size) until an eviction inside the segment makes them explicit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

SUPPORTED_BITS = (2, 4, 8)
_EPS = 1e-6


# ---------------------------------------------------------------------------- bit packing
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) along the last dim -> uint8, 8/bits codes per byte (first code in low bits)."""
    per_byte = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per_byte):
        out |= c[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n] -> uint8 codes [..., n * 8/bits]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


# ---------------------------------------------------------------------------- asymmetric min/max quantizer
def quantize(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None):
    """Asymmetric quantization with one (scale, min) per slice along `dim`. Returns (codes uint8, scale fp16,
    min fp16); `valid` (broadcastable to x) excludes entries from the min/max."""
    levels = (1 << bits) - 1
    xf = x.float()
    lo_src = xf if valid is None else xf.masked_fill(~valid, float("inf"))
    hi_src = xf if valid is None else xf.masked_fill(~valid, float("-inf"))
    lo = lo_src.amin(dim, keepdim=True)
    hi = hi_src.amax(dim, keepdim=True)
    empty = ~torch.isfinite(lo)  # every entry invalid
    lo = lo.masked_fill(empty, 0.0)
    hi = hi.masked_fill(empty, 0.0)
    scale = ((hi - lo) / levels).clamp(min=_EPS).half()  # guard constant groups (scale 0)
    lo = lo.half()
    codes = torch.round((xf - lo.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return codes, scale.squeeze(dim), lo.squeeze(dim)


# ---------------------------------------------------------------------------- the quantized segment
@dataclass
class QuantizedSegment:
    """Tensors of the quantized slots of one layer. All per-slot tensors are [B, Hkv, T, ...]."""

    bits: int
    group_size: int
    k_codes: torch.Tensor  # uint8 [B, H, T, D*bits/8]
    k_scale: torch.Tensor  # fp16 [B, H, Ng, D]   per channel, per group of slots
    k_min: torch.Tensor
    v_codes: torch.Tensor  # uint8 [B, H, T, D*bits/8]
    v_scale: torch.Tensor  # fp16 [B, H, T, D/G]  per slot, per group of channels
    v_min: torch.Tensor
    k_group: torch.Tensor | None = None  # int32 [B, H, T]; None: slot // group_size
    # GEAR only: exact outliers (per slot: channel index + value) and low-rank error factors per chunk
    k_out_idx: torch.Tensor | None = None  # uint8/int16 [B, H, T, n_out]
    k_out_val: torch.Tensor | None = None  # fp16 [B, H, T, n_out]
    v_out_idx: torch.Tensor | None = None
    v_out_val: torch.Tensor | None = None
    k_lr: torch.Tensor | None = None  # fp16 [B, H, T, r]      row factor of each slot
    v_lr: torch.Tensor | None = None
    k_basis: torch.Tensor | None = None  # fp16 [B, H, Nc, D, r] one basis per encoded chunk
    v_basis: torch.Tensor | None = None
    chunk: torch.Tensor | None = None  # int32 [B, H, T] chunk of each slot (GEAR)

    _PER_SLOT = ("k_codes", "v_codes", "v_scale", "v_min", "k_group", "k_out_idx", "k_out_val", "v_out_idx",
                 "v_out_val", "k_lr", "v_lr", "chunk")

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[-1] * 8 // self.bits

    def tensors(self):
        return [getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def key_groups(self) -> torch.Tensor:
        if self.k_group is not None:
            return self.k_group
        batch, heads, length = self.k_codes.shape[:3]
        groups = torch.arange(length, device=self.k_codes.device, dtype=torch.int32) // self.group_size
        return groups.expand(batch, heads, length)

    # -- growth, compaction, batch ops
    def append(self, other: "QuantizedSegment") -> "QuantizedSegment":
        """Concatenate slots (other's groups/chunks are renumbered after ours)."""
        explicit = self.k_group is not None or other.k_group is not None
        merged = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "k_group":
                merged[f.name] = (torch.cat([self.key_groups(), other.key_groups() + self.k_scale.shape[2]], 2)
                                  if explicit else None)
            elif f.name == "chunk" and a is not None:
                merged[f.name] = torch.cat([a, b + self.k_basis.shape[2]], 2)
            elif isinstance(a, torch.Tensor):
                merged[f.name] = torch.cat([a, b], 2)
            else:
                merged[f.name] = a
        return QuantizedSegment(**merged)

    def gather(self, indices: torch.Tensor) -> "QuantizedSegment":
        """Keep slots `indices` [B, H, T'] (rows of every per-slot tensor); group scales stay shared."""
        if self.k_group is None:
            self = replace(self, k_group=self.key_groups().contiguous())
        out = {}
        for name in self._PER_SLOT:
            t = getattr(self, name)
            if t is None:
                continue
            idx = indices if t.dim() == 3 else indices[..., None].expand(*indices.shape, t.shape[-1])
            out[name] = t.gather(2, idx)
        return replace(self, **out)

    def map_rows(self, fn) -> "QuantizedSegment":
        """Apply a batch-dimension op (beam reorder, repeat) to every tensor."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    # -- reading (block by block: never a full-precision copy of the whole segment)
    def dequantize_keys(self, start: int, end: int) -> torch.Tensor:
        """fp32 keys [B, H, end-start, D] of a block of slots (GEAR terms included)."""
        dim = self.head_dim
        codes = unpack(self.k_codes[:, :, start:end], self.bits).float()
        groups = self.key_groups()[:, :, start:end].long()[..., None].expand(-1, -1, -1, dim)
        k = codes * self.k_scale.float().gather(2, groups) + self.k_min.float().gather(2, groups)
        if self.k_out_idx is not None:
            k = self._correct(k, start, end, self.k_out_idx, self.k_out_val, self.k_lr, self.k_basis)
        return k

    def dequantize_values(self, start: int, end: int) -> torch.Tensor:
        """fp32 values [B, H, end-start, D] of a block of slots (GEAR terms included)."""
        per = self.head_dim // self.v_scale.shape[-1]
        codes = unpack(self.v_codes[:, :, start:end], self.bits).float()
        v = codes * self.v_scale[:, :, start:end].float().repeat_interleave(per, -1) \
            + self.v_min[:, :, start:end].float().repeat_interleave(per, -1)
        if self.v_out_idx is not None:
            v = self._correct(v, start, end, self.v_out_idx, self.v_out_val, self.v_lr, self.v_basis)
        return v

    def dequantize(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantize_keys(start, end), self.dequantize_values(start, end)

    def _correct(self, x, start, end, out_idx, out_val, lr, basis):
        chunk = self.chunk[:, :, start:end].long()
        b = basis.float().gather(2, chunk[..., None, None].expand(-1, -1, -1, *basis.shape[3:]))  # [B,H,n,D,r]
        x = x + torch.einsum("bhnr,bhndr->bhnd", lr[:, :, start:end].float(), b)
        return x.scatter(-1, out_idx[:, :, start:end].long(), out_val[:, :, start:end].float())


def encode_kivi(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, bits: int, group_size: int):
    """Quantize n slots (n a multiple of group_size) of K/V [B, H, n, D]; `valid` [B, H, n] excludes padding
    and filler slots from the ranges."""
    batch, heads, n, dim = k.shape
    g = group_size
    kg = k.reshape(batch, heads, n // g, g, dim)
    kvalid = valid.reshape(batch, heads, n // g, g, 1)
    k_codes, k_scale, k_min = quantize(kg, bits, dim=3, valid=kvalid)  # per channel over g slots
    vg = v.reshape(batch, heads, n, dim // g, g)
    v_codes, v_scale, v_min = quantize(vg, bits, dim=4)  # per slot over g channels
    return QuantizedSegment(
        bits=bits, group_size=g,
        k_codes=pack(k_codes.reshape(batch, heads, n, dim), bits), k_scale=k_scale, k_min=k_min,
        v_codes=pack(v_codes.reshape(batch, heads, n, dim), bits), v_scale=v_scale, v_min=v_min,
    )


def _split_outliers(x: torch.Tensor, n_out: int):
    """Per slot row: the n_out largest and n_out smallest entries, kept exactly; replaced by the row mean."""
    top = x.topk(n_out, dim=-1).indices
    bottom = (-x).topk(n_out, dim=-1).indices
    idx = torch.cat([top, bottom], -1)
    vals = x.gather(-1, idx)
    filled = x.scatter(-1, idx, x.mean(-1, keepdim=True).expand_as(idx).contiguous())
    return filled, idx, vals


def _low_rank(err: torch.Tensor, rank: int, iters: int, seed: int):
    """Rank-r power iteration per (row, head) in fp32: err [B, H, n, D] ~= a @ basis^T, a [B,H,n,r],
    basis [B,H,D,r]. Orthonormalised once, at the end."""
    batch, heads, n, dim = err.shape
    gen = torch.Generator(device=err.device).manual_seed(seed)
    p = torch.randn(batch, heads, dim, rank, generator=gen, device=err.device)
    for _ in range(iters):
        qb = err @ p
        p = err.transpose(-1, -2) @ qb
    qb, _ = torch.linalg.qr(err @ p)  # [B,H,n,r] orthonormal columns
    basis = err.transpose(-1, -2) @ qb  # [B,H,D,r]
    return qb, basis


def encode_gear(k, v, valid, bits, group_size, rank, outlier_ratio, power_iters, seed=0):
    """GEAR: X ~= deq(Q(X - S)) with outliers S restored exactly, + a rank-r correction of what remains."""
    dim = k.shape[-1]
    n_out = max(1, round(outlier_ratio * dim / 2)) if outlier_ratio > 0 else 0
    parts, extras = [], {}
    for name, x in (("k", k), ("v", v)):
        x = x.float() * valid[..., None]
        if n_out:
            x_in, idx, vals = _split_outliers(x, n_out)
        else:
            x_in, idx, vals = x, x.new_zeros(*x.shape[:3], 0, dtype=torch.long), x.new_zeros(*x.shape[:3], 0)
        parts.append(x_in)
        extras[name] = (x, idx, vals)
    seg = encode_kivi(parts[0], parts[1], valid, bits, group_size)
    idx_dtype = torch.uint8 if dim <= 256 else torch.int16
    seg = replace(seg, k_out_idx=extras["k"][1].to(idx_dtype), k_out_val=extras["k"][2].half(),
                  v_out_idx=extras["v"][1].to(idx_dtype), v_out_val=extras["v"][2].half())
    # the error that quantization + outliers leave, corrected by a low-rank term
    zero_lr = torch.zeros(*k.shape[:3], rank, device=k.device, dtype=torch.float16)
    zero_basis = torch.zeros(*k.shape[:2], 1, dim, rank, device=k.device, dtype=torch.float16)
    chunk = torch.zeros(k.shape[:3], dtype=torch.int32, device=k.device)
    probe = replace(seg, k_lr=zero_lr, v_lr=zero_lr, k_basis=zero_basis, v_basis=zero_basis, chunk=chunk)
    k_hat, v_hat = probe.dequantize(0, k.shape[2])
    k_a, k_b = _low_rank((extras["k"][0] - k_hat) * valid[..., None], rank, power_iters, seed)
    v_a, v_b = _low_rank((extras["v"][0] - v_hat) * valid[..., None], rank, power_iters, seed + 1)
    return replace(probe, k_lr=k_a.half(), v_lr=v_a.half(), k_basis=k_b[:, :, None].half(),
                   v_basis=v_b[:, :, None].half())
