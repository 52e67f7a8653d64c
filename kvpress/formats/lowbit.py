"""The low-bit code layout of KIVI/GEAR (the encoders are kvpress/cache/codecs.py): what the kernels read.

Layout. Codes are bit-packed into uint8 along the channel axis, one row per token slot, so evicting slots is
a row gather. Keys are quantized per channel over groups of `group_size` consecutive slots (their fp16
scale/min live per group); values per token over groups of `group_size` channels. Key-group ids are implicit
(slot // group_size) until an eviction inside the codes makes them explicit. `LowBitCodes` is the payload of
a low-bit storage segment (kvpress/cache/payloads.py): rectangular [B, Hkv, T] or one flat store [1, 1, N] of
per-head runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from . import checked
from .slots import take_slots

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


def unpack_floats(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack(packed, bits)` as fp32, each bit-field written straight into its channels of one float buffer (no
    stacked uint8 copy, no second conversion)."""
    per_byte, field = 8 // bits, (1 << bits) - 1
    out = torch.empty(*packed.shape, per_byte, dtype=torch.float32, device=packed.device)
    for i in range(per_byte):
        out[..., i] = (packed >> (i * bits)) & field if i else packed & field
    return out.view(*packed.shape[:-1], packed.shape[-1] * per_byte)


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



# ---------------------------------------------------------------------------- the codes of a segment
@dataclass
class LowBitCodes:
    """Tensors of the quantized slots of one segment. All per-slot tensors are [B, Hkv, T, ...]. A storage payload
    (the protocol of kvpress/cache/payloads.py)."""

    low_bit: ClassVar[bool] = True  # the payload kind: codes, read through the low-bit kernels
    storage_kind: ClassVar[str | None] = None  # its reader follows from low_bit and the layout
    key_dtype: ClassVar[torch.dtype] = torch.float32  # keys are read back (dequantized) in fp32

    bits: int
    group_size: int
    k_codes: torch.Tensor  # uint8 [B, H, T, D*bits/8]
    k_scale: torch.Tensor  # fp16 [B, H, Ng, D]   per channel, per group of slots
    k_min: torch.Tensor
    v_codes: torch.Tensor  # uint8 [B, H, T, D*bits/8]
    v_scale: torch.Tensor  # fp16 [B, H, T, D/G]  per slot, per group of channels
    v_min: torch.Tensor
    k_group: torch.Tensor | None = None  # int32 [B, H, T]; None: slot // group_size
    # GEAR only. Key outliers are per channel (sparse entries: slot, channel, exact value; slot -1 once the
    # token is evicted); value outliers per slot row (channel index + exact value).
    k_out_slot: torch.Tensor | None = None  # int32 [B, H, N]
    k_out_chan: torch.Tensor | None = None  # uint8/int16 [B, H, N]
    k_out_val: torch.Tensor | None = None  # fp16 [B, H, N]
    v_out_idx: torch.Tensor | None = None  # uint8/int16 [B, H, T, n_out]
    v_out_val: torch.Tensor | None = None  # fp16 [B, H, T, n_out]
    k_lr: torch.Tensor | None = None  # fp16 [B, H, T, r]      row factor of each slot
    v_lr: torch.Tensor | None = None
    k_basis: torch.Tensor | None = None  # fp16 [B, H, Nc, D, r] one basis per encoded chunk
    v_basis: torch.Tensor | None = None
    chunk: torch.Tensor | None = None  # int32 [B, H, T] chunk of each slot (GEAR)

    _PER_SLOT = ("k_codes", "v_codes", "v_scale", "v_min", "k_group", "v_out_idx", "v_out_val", "k_lr", "v_lr",
                 "chunk")

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[-1] * 8 // self.bits

    @property
    def batch_heads(self) -> tuple[int, int]:
        return self.k_codes.shape[0], self.k_codes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    def detach(self) -> "LowBitCodes":
        """Codes are never written in place (appends build new tensors): the same payload may be shared."""
        return self

    def tensors(self):
        return [getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def shared_tensors(self) -> list:
        return []

    def offloaded_nbytes(self) -> int:
        return 0

    def check(self, where: str, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Refuse (ValueError naming the field) codes a model of this head size never stores: a file's, before
        anything reads them (every index in range, every scale finite; the protocol of kvpress/cache/payloads.py)."""
        bits = checked.integer(self.bits, f"{where}.bits")
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"{where}.bits={bits}; allowed values: {list(SUPPORTED_BITS)}")
        group = checked.integer(self.group_size, f"{where}.group_size", 1)
        packed = head_dim * bits // 8
        t = checked.tensor(self.k_codes, f"{where}.k_codes", torch.uint8, (batch, heads, None, packed)).shape[2]
        checked.tensor(self.v_codes, f"{where}.v_codes", torch.uint8, (batch, heads, t, packed))
        n_groups = checked.tensor(self.k_scale, f"{where}.k_scale", torch.float16, (batch, heads, None, head_dim),
                                 finite=True).shape[2]
        checked.tensor(self.k_min, f"{where}.k_min", torch.float16, tuple(self.k_scale.shape), finite=True)
        v_groups = checked.tensor(self.v_scale, f"{where}.v_scale", torch.float16, (batch, heads, t, None),
                                 finite=True).shape[3]
        if v_groups < 1 or head_dim % v_groups:
            raise ValueError(f"{where}.v_scale: {v_groups} value groups per slot; allowed: a divisor of {head_dim}")
        checked.tensor(self.v_min, f"{where}.v_min", torch.float16, tuple(self.v_scale.shape), finite=True)
        if self.k_group is None:
            if n_groups * group < t:
                raise ValueError(f"{where}.k_scale: {n_groups} key groups for {t} slots in groups of {group}")
        else:
            checked.within(checked.tensor(self.k_group, f"{where}.k_group", torch.int32, (batch, heads, t)),
                          f"{where}.k_group", 0, n_groups)
        gear = ("k_out_slot", "k_out_chan", "k_out_val", "v_out_idx", "v_out_val", "k_lr", "v_lr", "k_basis",
                "v_basis", "chunk")
        present = [name for name in gear if getattr(self, name) is not None]
        if not present:
            return
        if len(present) != len(gear):
            raise ValueError(f"{where}: GEAR terms {present} without {sorted(set(gear) - set(present))}")
        channel = (torch.uint8, torch.int16)
        n_out = checked.tensor(self.k_out_slot, f"{where}.k_out_slot", torch.int32, (batch, heads, None)).shape[2]
        checked.within(self.k_out_slot, f"{where}.k_out_slot", -1, t)
        checked.within(checked.tensor(self.k_out_chan, f"{where}.k_out_chan", channel, (batch, heads, n_out)),
                      f"{where}.k_out_chan", 0, head_dim)
        checked.tensor(self.k_out_val, f"{where}.k_out_val", torch.float16, (batch, heads, n_out), finite=True)
        per_row = checked.tensor(self.v_out_idx, f"{where}.v_out_idx", channel, (batch, heads, t, None)).shape[3]
        checked.within(self.v_out_idx, f"{where}.v_out_idx", 0, head_dim)
        checked.tensor(self.v_out_val, f"{where}.v_out_val", torch.float16, (batch, heads, t, per_row), finite=True)
        chunks = checked.tensor(self.k_basis, f"{where}.k_basis", torch.float16, (batch, heads, None, head_dim, None),
                               finite=True).shape[2]
        for kind in ("k", "v"):
            rank = checked.tensor(getattr(self, f"{kind}_lr"), f"{where}.{kind}_lr", torch.float16,
                                 (batch, heads, t, None), finite=True).shape[3]
            checked.tensor(getattr(self, f"{kind}_basis"), f"{where}.{kind}_basis", torch.float16,
                          (batch, heads, chunks, head_dim, rank), finite=True)
        checked.within(checked.tensor(self.chunk, f"{where}.chunk", torch.int32, (batch, heads, t)), f"{where}.chunk",
                      0, chunks)

    def key_groups(self) -> torch.Tensor:
        if self.k_group is not None:
            return self.k_group
        batch, heads, length = self.k_codes.shape[:3]
        groups = torch.arange(length, device=self.k_codes.device, dtype=torch.int32) // self.group_size
        return groups.expand(batch, heads, length)

    # -- growth, compaction, batch ops
    def cat(self, other: "LowBitCodes") -> "LowBitCodes":
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
            elif f.name == "k_out_slot" and a is not None:
                merged[f.name] = torch.cat([a, torch.where(b >= 0, b + self.num_slots, b)], 2)
            elif isinstance(a, torch.Tensor):
                merged[f.name] = torch.cat([a, b], 2)
            else:
                merged[f.name] = a
        return LowBitCodes(**merged)

    def gather(self, indices: torch.Tensor, real: torch.Tensor | None = None) -> "LowBitCodes":
        """Keep slots `indices` [B, H, T'] (rows of every per-slot tensor); group scales stay shared. `real`
        flags which kept slots are real (not fillers), so sparse entries follow only real tokens."""
        if self.k_group is None:
            self = replace(self, k_group=self.key_groups().contiguous())
        out = {}
        if self.k_out_slot is not None:
            new_index = torch.full(self.k_codes.shape[:3], -1, dtype=torch.int32, device=indices.device)
            kept = torch.arange(indices.shape[-1], dtype=torch.int32, device=indices.device).expand_as(indices)
            if real is not None:  # fillers point at arbitrary slots: route them to a dummy column
                indices_real = torch.where(real, indices, new_index.shape[-1])
                new_index = torch.cat([new_index, new_index[..., :1]], -1)
                new_index.scatter_(-1, indices_real, kept)
                new_index = new_index[..., :-1]
            else:
                new_index.scatter_(-1, indices, kept)
            slot = self.k_out_slot.long()
            out["k_out_slot"] = torch.where(slot >= 0, new_index.gather(-1, slot.clamp(min=0)), -1)
        for name in self._PER_SLOT:
            t = getattr(self, name)
            if t is not None:
                out[name] = t.gather(2, indices) if t.dim() == 3 else take_slots(t, indices)
        return replace(self, **out)

    def map_rows(self, fn) -> "LowBitCodes":
        """Apply a batch-dimension op (beam reorder, repeat) to every tensor."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device) -> "LowBitCodes":
        return self.map_rows(lambda t: t.to(device))

    def flatten(self, ok: torch.Tensor) -> "LowBitCodes":
        """The slots where ok [B, H, T] as one flat store [1, 1, N] in (row, head, slot) order. Every (row, head)
        keeps its own key groups (renumbered; groups left without a slot are dropped) and GEAR chunks; key
        outlier entries follow their slot (-1 once it is dropped)."""
        batch, heads, length = ok.shape
        bh = batch * heads
        groups = self.key_groups().long() + (torch.arange(bh, device=ok.device).view(batch, heads, 1)
                                             * self.k_scale.shape[2])
        kept_groups = groups[ok]
        used = torch.zeros(bh * self.k_scale.shape[2], dtype=torch.bool, device=ok.device)
        used[kept_groups] = True
        renumber = used.long().cumsum(0) - 1
        out = dict(
            k_group=renumber[kept_groups].to(torch.int32)[None, None],
            k_scale=self.k_scale.reshape(bh * self.k_scale.shape[2], self.k_scale.shape[3])[used][None, None],
            k_min=self.k_min.reshape(bh * self.k_min.shape[2], self.k_min.shape[3])[used][None, None],
        )
        for name in self._PER_SLOT:
            t = getattr(self, name)
            if t is not None and name not in ("k_group", "chunk"):
                out[name] = t[ok][None, None]
        if self.chunk is not None:
            n_chunks = self.k_basis.shape[2]
            offset = torch.arange(bh, device=ok.device).view(batch, heads, 1) * n_chunks
            out["chunk"] = (self.chunk.long() + offset)[ok].to(torch.int32)[None, None]
            out["k_basis"] = self.k_basis.reshape(1, 1, bh * n_chunks, *self.k_basis.shape[3:])
            out["v_basis"] = self.v_basis.reshape(1, 1, bh * n_chunks, *self.v_basis.shape[3:])
        if self.k_out_slot is not None:
            new_slot = torch.full((batch, heads, length), -1, dtype=torch.long, device=ok.device)
            new_slot[ok] = torch.arange(int(ok.sum()), device=ok.device)
            slot = self.k_out_slot.long()
            mapped = torch.where(slot >= 0, new_slot.gather(-1, slot.clamp(min=0)), -1)
            out["k_out_slot"] = mapped.reshape(1, 1, -1).to(torch.int32)
            out["k_out_chan"] = self.k_out_chan.reshape(1, 1, -1)
            out["k_out_val"] = self.k_out_val.reshape(1, 1, -1)
        return replace(self, **out)

    # -- reading (block by block: never a full-precision copy of the whole segment)
    def _codes(self, packed: torch.Tensor, precision: int | None) -> torch.Tensor:
        """Unpacked codes as floats; precision=4 on an 8-bit segment reads only the upper nibble, placed at
        the middle of its 16-code bucket (QuantSpec's INT4 draft view of the INT8 cache)."""
        if precision is None or precision == self.bits:
            return unpack_floats(packed, self.bits)
        if self.bits != 8 or precision != 4:
            raise ValueError(f"precision={precision}; allowed values: None, or 4 on an 8-bit segment")
        return (unpack(packed, self.bits) >> 4).float() * 16 + 7.5

    def dequantize_keys(self, start: int, end: int, precision: int | None = None) -> torch.Tensor:
        """fp32 keys [B, H, end-start, D] of a block of slots (GEAR terms included)."""
        dim = self.head_dim
        codes = self._codes(self.k_codes[:, :, start:end], precision)
        g = self.group_size
        if self.k_group is None and start % g == 0 and (end - start) % g == 0:
            # whole groups in slot order: each group's scale/min broadcast over its g slots, no expanded copies
            batch, heads, n, _ = codes.shape
            grouped = codes.view(batch, heads, n // g, g, dim)
            sl = slice(start // g, end // g)
            k = grouped.mul_(self.k_scale[:, :, sl, None].float()).add_(self.k_min[:, :, sl, None].float())
            k = k.view(batch, heads, n, dim)
        else:
            if self.k_group is None:  # a block that cuts a group: expand the block's group scales
                sl = slice(start // g, (end + g - 1) // g)
                offset = start % g
                scale = self.k_scale[:, :, sl].float().repeat_interleave(g, 2)[:, :, offset:offset + end - start]
                low = self.k_min[:, :, sl].float().repeat_interleave(g, 2)[:, :, offset:offset + end - start]
            else:
                groups = self.k_group[:, :, start:end].long()[..., None].expand(-1, -1, -1, dim)
                scale, low = self.k_scale.float().gather(2, groups), self.k_min.float().gather(2, groups)
            k = codes.mul_(scale).add_(low)
        if self.k_lr is not None:
            k = self._add_low_rank(k, start, end, self.k_lr, self.k_basis)
            # exact per-channel outliers of the slots in this block (the others go to a dummy column)
            slot = self.k_out_slot.long()
            inside = (slot >= start) & (slot < end)
            flat = torch.where(inside, (slot - start) * dim + self.k_out_chan.long(), (end - start) * dim)
            k = torch.cat([k.flatten(2), k.new_zeros(*k.shape[:2], 1)], -1)
            k = k.scatter(-1, flat, self.k_out_val.float())[..., :-1].view(*k.shape[:2], end - start, dim)
        return k

    def dequantize_values(self, start: int, end: int, precision: int | None = None) -> torch.Tensor:
        """fp32 values [B, H, end-start, D] of a block of slots (GEAR terms included)."""
        n_groups = self.v_scale.shape[-1]
        codes = self._codes(self.v_codes[:, :, start:end], precision)
        batch, heads, n, dim = codes.shape
        # each slot's per-channel-group scale/min broadcast over the group's channels
        v = codes.view(batch, heads, n, n_groups, dim // n_groups)
        v = v.mul_(self.v_scale[:, :, start:end, :, None].float()).add_(self.v_min[:, :, start:end, :, None].float())
        v = v.view(batch, heads, n, dim)
        if self.v_lr is not None:
            v = self._add_low_rank(v, start, end, self.v_lr, self.v_basis)
            v = v.scatter(-1, self.v_out_idx[:, :, start:end].long(), self.v_out_val[:, :, start:end].float())
        return v

    def dequantize(self, start: int, end: int, precision: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantize_keys(start, end, precision), self.dequantize_values(start, end, precision)

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """Every slot's keys as a transient dequantized copy in `dtype` (for policies that score keys; attention
        reads the codes through the kernels, never this)."""
        return self.dequantize_keys(0, self.num_slots).to(dtype)

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_values(0, self.num_slots).to(dtype)

    def _add_low_rank(self, x, start, end, lr, basis):
        # each slot's row factor placed in its chunk's column block, then one matmul against every chunk's
        # basis: no per-slot copy of a [D, r] basis
        batch, heads, n_chunks, dim, rank = basis.shape
        chunk = self.chunk[:, :, start:end].long()
        rows = x.new_zeros(batch, heads, end - start, n_chunks, rank)
        rows.scatter_(3, chunk[..., None, None].expand(-1, -1, -1, 1, rank), lr[:, :, start:end, None].float())
        bases = basis.float().transpose(-1, -2).reshape(batch, heads, n_chunks * rank, dim)
        return x + rows.view(batch, heads, end - start, n_chunks * rank) @ bases
