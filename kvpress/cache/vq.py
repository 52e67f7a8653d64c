"""CommVQ storage (policies/commvq.py): slots as additive vector-quantization codes, read by decoding them.

Per slot and KV head the payload holds
  codes       uint8 [B, Hkv, T, 3 ceil(n / 2) / 2]  the key's G x Sk and the value's G x Sv 12-bit codes (n in all),
              packed two codes to three bytes
  k_norm, v_norm  fp16 [B, Hkv, T]   the vectors' L2 norms (the codes approximate the unit vector)
  rope        int32 [B, Hkv, T]  the RoPE position the model rotated the key at (keys are coded before RoPE); None
              while the slots are consecutive from `rope_start` [B, 1, 1] (a row's prompt, coded in order): no bytes
  head        uint8 [1, 1, N]    in a flat store only: the KV head of each slot (its codebook)
The codebooks (`VQBook`: one layer's tables, from the model's calibration file) are the model's, shared by every
request like its weights, and are not counted in `nbytes()`.

A read (`slots`, `VQBook.tables`) hands the codes to kernels/vq_read.py: each key decoded once per slot (the
codewords' sum times the norm, then RoPE at the slot's position: the codewords commute with RoPE, formats/commvq.py),
the values never (the attention weights are summed per codebook row). `dequantize` decodes a block of slots into
fp32, for policies that score keys and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from ..formats.commvq import bag_weights, decode, pack12, unpack12
from ..formats.slots import take_slots
from ..kernels.vq_read import VQSlots, VQTables
from ..kernels.vq_search import Prepared, encode, prepare
from ..positions import apply_rotary, unrotate
from .held import tensors_in

VQ = "vq"


class RopeTable:
    """cos / sin fp32 [n, rot / 2] of one RoPE by position 0..n-1, grown (doubling) when a longer one is asked:
    computed once per model, not per read. One per distinct rotary, shared by the layers' books (CommVQ.for_model)."""

    def __init__(self, rotary):
        self.rotary = rotary  # positions.Rotary
        self._table: tuple | None = None  # (cos, sin), replaced whole when grown (a concurrent reader keeps its own)

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor):
        return self.rotary.cos_sin(positions, like)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._table or ())

    def by_position(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) covering positions 0..n-1 at least."""
        table = self._table
        if table is None or table[0].shape[0] < n or table[0].device != torch.device(device):
            size = max(n, 1024, 2 * (0 if table is None else table[0].shape[0]))
            cos, sin = self.rotary.cos_sin(torch.arange(size, device=device)[None],
                                           torch.empty(0, device=device, dtype=torch.float32))
            half = cos.shape[-1] // 2  # half-split RoPE: the two halves hold the same cos / sin
            table = self._table = (cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous())
        return table


@dataclass
class VQBook:
    """One layer's codebooks: tables [Hkv, G, S, P, 64] complex for keys and values, and the layer's RoPE."""

    keys: torch.Tensor
    values: torch.Tensor
    rotary: RopeTable
    # what is derived from the tables once: bag weights per (kind, head, device), the stacked ones per device,
    # the encoder's prepared tables per (kind, head)
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def tensors(self) -> list[torch.Tensor]:
        """The model's tables this book holds, and what it derived from them (the cache's codes read them all)."""
        return [self.keys, self.values, *self.rotary.tensors(), *tensors_in(self._derived)]

    def codes_per_slot(self, kind: str) -> int:
        tables = getattr(self, kind)
        return tables.shape[1] * tables.shape[2]

    def weights(self, kind: str, head: int, device) -> torch.Tensor:
        key = (kind, head, str(device))
        if key not in self._derived:
            self._derived[key] = bag_weights(getattr(self, kind)[head]).to(device)
        return self._derived[key]

    def prepared(self, kind: str, head: int) -> Prepared:
        """What the encoder derives from one head's tables, built once (every flush searches the same tables)."""
        key = ("search", kind, head)
        if key not in self._derived:
            self._derived[key] = prepare(getattr(self, kind)[head])
        return self._derived[key]

    def cos_sin(self, rope: torch.Tensor, like: torch.Tensor):
        """cos, sin [N, 1, rot] at positions rope [N] (one row per slot)."""
        return self.rotary.cos_sin(rope.reshape(-1, 1).long(), like)

    def tables(self, positions: int, device) -> VQTables:
        """The decoder's weights of every head and the RoPE table covering `positions`, for kernels/vq_read.py."""
        key = ("stacked", str(device))
        if key not in self._derived:
            self._derived[key] = tuple(torch.stack([self.weights(kind, h, device) for h in range(self.keys.shape[0])])
                                       for kind in ("keys", "values"))
        cos, sin = self.rotary.by_position(positions, device)
        return VQTables(*self._derived[key], cos, sin)


def encode_commvq(keys, values, valid, rope, book: VQBook) -> "VQCodes":
    """Codes of slots keys, values [B, Hkv, n, D] (post-RoPE keys, rotated at `rope` [B, Hkv, n]); fillers (not
    `valid`) are coded as zero vectors."""
    batch, heads, n, dim = keys.shape
    mask = valid[..., None]
    cos, sin = book.cos_sin(rope, keys.new_empty(0, dtype=torch.float32))
    pre_rope = unrotate(keys.reshape(-1, 1, 1, dim), cos, sin).view(batch, heads, n, dim) * mask
    codes, norms = [], {}
    for kind, x in (("keys", pre_rope), ("values", values.float() * mask)):
        per_head = [encode(x[:, h].reshape(-1, dim), getattr(book, kind)[h], book.prepared(kind, h))
                    for h in range(heads)]
        codes.append(torch.stack([c.view(batch, n, -1) for c, _ in per_head], 1))  # [B, Hkv, n, G * S]
        norms[kind] = torch.stack([m.view(batch, n) for _, m in per_head], 1).half()
    start = rope[:, :1, :1]
    consecutive = bool((rope == start + torch.arange(n, device=rope.device)).all())
    return VQCodes(pack12(torch.cat(codes, -1)), norms["keys"], norms["values"],
                   None if consecutive else rope.to(torch.int32).contiguous(),
                   start.to(torch.int32).contiguous() if consecutive else None, None, book)


@dataclass
class VQCodes:
    """Tensors of the CommVQ-coded slots of one segment (module docstring). Follows `Payload` (payloads.py)."""

    low_bit: ClassVar[bool] = True  # codes: a codec's segment, ahead of the full-precision tail
    storage_kind: ClassVar[str | None] = VQ
    key_dtype: ClassVar[torch.dtype] = torch.float32

    codes: torch.Tensor
    k_norm: torch.Tensor
    v_norm: torch.Tensor
    rope: torch.Tensor | None
    rope_start: torch.Tensor | None
    head: torch.Tensor | None
    book: VQBook

    @property
    def num_slots(self) -> int:
        return self.k_norm.shape[2]

    @property
    def batch_heads(self) -> tuple[int, int]:
        return self.k_norm.shape[0], self.k_norm.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k_norm.device

    def _per_slot(self) -> list[str]:
        return [name for name in ("codes", "k_norm", "v_norm", "rope", "head") if getattr(self, name) is not None]

    def _explicit(self) -> "VQCodes":
        """The same slots with every RoPE position stored (before slots are dropped, reordered or merged)."""
        if self.rope is not None:
            return self
        return replace(self, rope=self.rope_positions(0, self.num_slots).contiguous(), rope_start=None)

    # -- decoding
    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """int32 [b, h, end - start] RoPE positions of a block of slots."""
        if self.rope is not None:
            return self.rope[:, :, start:end]
        steps = torch.arange(start, end, device=self.device, dtype=torch.int32)
        return (self.rope_start + steps).expand(*self.batch_heads, -1)

    def _heads(self, start: int, end: int) -> torch.Tensor:
        """[b, h, end - start] the KV head (codebook) of each slot."""
        if self.head is not None:
            return self.head[:, :, start:end].long()
        batch, heads = self.batch_heads
        return torch.arange(heads, device=self.device).view(1, heads, 1).expand(batch, heads, end - start)

    def _unpacked(self, start: int, end: int) -> torch.Tensor:
        """int64 [b, h, end - start, n] the key codes, then the value codes, of a block of slots."""
        count = self.book.codes_per_slot("keys") + self.book.codes_per_slot("values")
        return unpack12(self.codes[:, :, start:end], count)

    def _decoded(self, kind: str, codes: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """fp32 vectors [b, h, end - start, D] of one kind ('keys', before RoPE, or 'values') of a block of slots, from
        its unpacked `codes`."""
        n_keys = self.book.codes_per_slot("keys")
        part = codes[..., :n_keys] if kind == "keys" else codes[..., n_keys:]
        norms = (self.k_norm if kind == "keys" else self.v_norm)[:, :, start:end]
        tables = getattr(self.book, kind)
        groups, stages, pairs = tables.shape[1:4]
        part = part.view(*norms.shape, groups, stages)
        if self.head is None:  # a rectangle: head h is dim 1's h
            return torch.stack([decode(part[:, h], norms[:, h], self.book.weights(kind, h, self.device))
                                for h in range(tables.shape[0])], 1)
        heads = self._heads(start, end)
        vectors = torch.zeros(*norms.shape, 2 * groups * pairs, device=self.device)
        for h in range(tables.shape[0]):
            at = heads == h
            if bool(at.any()):
                vectors[at] = decode(part[at], norms[at], self.book.weights(kind, h, self.device))
        return vectors

    def slots(self, indices: torch.Tensor | None = None) -> VQSlots:
        """The slots for kernels/vq_read.py: every slot, or (a flat store [1, 1, N]) the slots at `indices` [B, Hkv, K]
        (a small gathered copy of their codes)."""
        rope = self.rope_positions(0, self.num_slots)
        tensors = (self.codes, self.k_norm, self.v_norm, rope)
        if indices is not None:
            tensors = tuple(t[0, 0][indices] for t in tensors)
        return VQSlots(*tensors)

    def dequantize(self, start: int, end: int, precision: int | None = None):
        """fp32 keys (post-RoPE) and values [b, h, end - start, D] of a block of slots."""
        codes = self._unpacked(start, end)  # (once for both kinds)
        return self._rotated_keys(codes, start, end), self._decoded("values", codes, start, end)

    def _rotated_keys(self, codes: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """fp32 post-RoPE keys [b, h, end - start, D]: decoded, then rotated at each slot's RoPE position."""
        keys = self._decoded("keys", codes, start, end)
        cos, sin = self.book.cos_sin(self.rope_positions(start, end), keys)
        return apply_rotary(keys.reshape(-1, 1, 1, keys.shape[-1]), cos, sin).view_as(keys)

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        return self._rotated_keys(self._unpacked(0, self.num_slots), 0, self.num_slots).to(dtype)  # (no values)

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self._decoded("values", self._unpacked(0, self.num_slots), 0, self.num_slots).to(dtype)

    # -- the Payload protocol
    def gather(self, indices: torch.Tensor, real: torch.Tensor | None = None) -> "VQCodes":
        self = self._explicit()
        return replace(self, **{name: (take_slots(t, indices) if t.dim() == 4 else t.gather(2, indices))
                                for name in self._per_slot() for t in [getattr(self, name)]})

    def cat(self, other: "VQCodes") -> "VQCodes":
        if not (self.rope is None and other.rope is None and torch.equal(other.rope_start,
                                                                         self.rope_start + self.num_slots)):
            self, other = self._explicit(), other._explicit()  # (else still consecutive: positions stay implicit)
        return replace(self, **{name: torch.cat([getattr(self, name), getattr(other, name)], 2)
                                for name in self._per_slot()})

    def flatten(self, ok: torch.Tensor) -> "VQCodes":
        """The slots where ok [b, h, t] as one flat store [1, 1, N], each slot with its KV head."""
        self = self._explicit()
        out = {name: getattr(self, name)[ok][None, None] for name in self._per_slot() if name != "head"}
        return replace(self, **out, head=self._heads(0, self.num_slots)[ok].to(torch.uint8)[None, None])

    def map_rows(self, fn) -> "VQCodes":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device) -> "VQCodes":
        return self.map_rows(lambda t: t.to(device))

    def detach(self) -> "VQCodes":
        return self  # never written in place

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def shared_tensors(self) -> list[torch.Tensor]:
        return self.book.tensors()

    def offloaded_nbytes(self) -> int:
        return 0
