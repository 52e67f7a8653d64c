"""CommVQ storage (policies/commvq.py): slots as additive vector-quantization codes, read by decoding them.

Per slot and KV head the payload holds
  k_codes, v_codes  uint8 [B, Hkv, T, 3 ceil(G S / 2) / 2]  the G groups x S stages of 12-bit codes, packed
  k_norm, v_norm    fp16 [B, Hkv, T]   the vectors' L2 norms (the codes approximate the unit vector)
  rope              int32 [B, Hkv, T]  the RoPE position the model rotated the key at (keys are coded before RoPE)
  head              uint8 [1, 1, N]    in a flat store only: the KV head of each slot (its codebook)
The codebooks (`VQBook`: one layer's tables, from the model's calibration file) are the model's, shared by every
request like its weights, and are not counted in `nbytes()`.

A read decodes the segment's keys (the codewords' sum times the norm, then RoPE at each slot's position: the
codewords commute with RoPE, formats/commvq.py) and values into a transient fp32 copy, and folds them into the online
softmax as the full-precision readers do. (The paper's kernel folds RoPE into per-codeword products instead; not
built here.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from ..formats.commvq import bag_weights, decode, encode, pack12, unpack12
from ..formats.slots import take_slots
from ..positions import apply_rotary, unrotate

VQ = "vq"


@dataclass
class VQBook:
    """One layer's codebooks: tables [Hkv, G, S, P, 64] complex for keys and values, and the layer's RoPE."""

    keys: torch.Tensor
    values: torch.Tensor
    rotary: object  # positions.Rotary
    _weights: dict = field(default_factory=dict, repr=False, compare=False)  # (kind, head, device) -> bag weights

    @property
    def groups_stages(self) -> int:
        return self.keys.shape[1] * self.keys.shape[2]

    def weights(self, kind: str, head: int, device) -> torch.Tensor:
        key = (kind, head, str(device))
        if key not in self._weights:
            self._weights[key] = bag_weights(getattr(self, kind)[head]).to(device)
        return self._weights[key]

    def cos_sin(self, rope: torch.Tensor, like: torch.Tensor):
        """cos, sin [N, 1, rot] at positions rope [N] (one row per slot)."""
        return self.rotary.cos_sin(rope.reshape(-1, 1).long(), like)


def encode_commvq(keys, values, valid, rope, book: VQBook) -> "VQCodes":
    """Codes of slots keys, values [B, Hkv, n, D] (post-RoPE keys, rotated at `rope` [B, Hkv, n]); fillers (not
    `valid`) are coded as zero vectors."""
    batch, heads, n, dim = keys.shape
    mask = valid[..., None]
    cos, sin = book.cos_sin(rope, keys.new_empty(0, dtype=torch.float32))
    pre_rope = unrotate(keys.reshape(-1, 1, 1, dim), cos, sin).view(batch, heads, n, dim) * mask
    values = values.float() * mask
    out = {}
    for kind, x in (("k", pre_rope), ("v", values)):
        tables = book.keys if kind == "k" else book.values
        per_head = [encode(x[:, h].reshape(-1, dim), tables[h]) for h in range(heads)]
        codes = torch.stack([c.view(batch, n, -1) for c, _ in per_head], 1)  # [B, Hkv, n, G * S]
        out[f"{kind}_codes"] = pack12(codes)
        out[f"{kind}_norm"] = torch.stack([m.view(batch, n) for _, m in per_head], 1).half()
    return VQCodes(**out, rope=rope.to(torch.int32).contiguous(), head=None, book=book)


@dataclass
class VQCodes:
    """Tensors of the CommVQ-coded slots of one segment (module docstring). Follows `Payload` (payloads.py)."""

    low_bit: ClassVar[bool] = True  # codes: a codec's segment, ahead of the full-precision tail
    storage_kind: ClassVar[str | None] = VQ
    key_dtype: ClassVar[torch.dtype] = torch.float32

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_norm: torch.Tensor
    v_norm: torch.Tensor
    rope: torch.Tensor
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

    def _slot_tensors(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    # -- decoding
    def _heads(self) -> torch.Tensor:
        """[b, h, t] the KV head (codebook) of each slot."""
        if self.head is not None:
            return self.head.long()
        batch, heads, length = self.k_norm.shape
        return torch.arange(heads, device=self.device).view(1, heads, 1).expand(batch, heads, length)

    def _decoded(self, kind: str, start: int, end: int) -> torch.Tensor:
        """fp32 vectors [b, h, end - start, D] of one kind ('keys' before RoPE, or 'values')."""
        codes = getattr(self, f"{kind[0]}_codes")[:, :, start:end]
        norms = getattr(self, f"{kind[0]}_norm")[:, :, start:end]
        tables = getattr(self.book, kind)
        groups, stages, dim = tables.shape[1], tables.shape[2], 2 * tables.shape[1] * tables.shape[3]
        codes = unpack12(codes, groups * stages).view(*norms.shape, groups, stages)
        heads = self._heads()[:, :, start:end]
        out = torch.zeros(*norms.shape, dim, device=self.device)
        for h in range(tables.shape[0]):
            at = heads == h
            if bool(at.any()):
                out[at] = decode(codes[at], norms[at], self.book.weights(kind, h, self.device))
        return out

    def dequantize(self, start: int, end: int, precision: int | None = None):
        """fp32 keys (post-RoPE) and values [b, h, end - start, D] of a block of slots."""
        keys = self._decoded("keys", start, end)
        cos, sin = self.book.cos_sin(self.rope[:, :, start:end], keys)
        keys = apply_rotary(keys.reshape(-1, 1, 1, keys.shape[-1]), cos, sin).view_as(keys)
        return keys, self._decoded("values", start, end)

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(0, self.num_slots)[0].to(dtype)

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self._decoded("values", 0, self.num_slots).to(dtype)

    # -- the Payload protocol
    def gather(self, indices: torch.Tensor, real: torch.Tensor | None = None) -> "VQCodes":
        return replace(self, **{name: (take_slots(t, indices) if t.dim() == 4 else t.gather(2, indices))
                                for name in self._slot_tensors() for t in [getattr(self, name)]})

    def cat(self, other: "VQCodes") -> "VQCodes":
        return replace(self, **{name: torch.cat([getattr(self, name), getattr(other, name)], 2)
                                for name in self._slot_tensors()})

    def flatten(self, ok: torch.Tensor) -> "VQCodes":
        """The slots where ok [b, h, t] as one flat store [1, 1, N], each slot with its KV head."""
        out = {name: getattr(self, name)[ok][None, None] for name in self._slot_tensors() if name != "head"}
        return replace(self, **out, head=self._heads()[ok].to(torch.uint8)[None, None])

    def map_rows(self, fn) -> "VQCodes":
        return replace(self, **{name: fn(getattr(self, name)) for name in self._slot_tensors()})

    def to(self, device) -> "VQCodes":
        return self.map_rows(lambda t: t.to(device))

    def detach(self) -> "VQCodes":
        return self  # never written in place

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._slot_tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def offloaded_nbytes(self) -> int:
        return 0
