"""Storage payloads: what a segment (segments.py) holds in its slots, and the one protocol every kind follows.

Three kinds: `FullPrecision` (keys/values as computed, below), `LowBitCodes` (KIVI/GEAR codes,
kvpress/formats/lowbit.py) and `ShadowKeys` (ShadowKV's low-rank keys and file-tier values, shadow.py). A segment
never asks which kind it holds: it calls the methods of `Payload`, and reads the kind's declared `low_bit` (or
`storage_kind`) where a layer must choose a kernel (the read table of read.py) or a layout.

The tail of a layer (where tokens are appended) is always full precision: `append`, `reserve`, `trim`,
`truncate`, `room` and `keys`/`values` belong to FullPrecision alone, and only the layer's tail and full-precision
segments use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch

from ..formats import checked
from ..formats.slots import take_slots


class Payload(Protocol):
    """Per-slot tensors [b, h, t, ...] of one segment, slot axis at dim 2. Every operation returns a new payload."""

    low_bit: ClassVar[bool]  # codes read through the low-bit kernels (True), or keys/values as computed
    storage_kind: ClassVar[str | None]  # a kind with a reader of its own (shadow.py); None: from low_bit and layout

    @property
    def num_slots(self) -> int: ...

    @property
    def batch_heads(self) -> tuple[int, int]: ...  # (b, h) of the per-slot tensors

    @property
    def device(self) -> torch.device: ...

    @property
    def key_dtype(self) -> torch.dtype: ...  # the dtype its readable keys come in (codes: fp32)

    def gather(self, indices: torch.Tensor, real: torch.Tensor | None = None) -> "Payload":
        """Keep slots `indices` [b, h, t'] (`real`: which of them are real tokens, not fillers)."""

    def cat(self, other: "Payload") -> "Payload":
        """Other's slots after ours (same kind)."""

    def flatten(self, ok: torch.Tensor) -> "Payload":
        """The slots where ok [b, h, t] as one flat store [1, 1, N], in (row, head, slot) order."""

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Payload":
        """A batch-axis op (index_select, repeat_interleave) applied to every tensor."""

    def to(self, device) -> "Payload": ...

    def detach(self) -> "Payload":
        """A payload that may be shared: never written in place by either holder."""

    def dequantize(self, start: int, end: int, precision: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 keys, values [b, h, end - start, D] of a block of slots."""

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """Keys [b, h, t, D] a policy can score (full precision: its own tensor, as stored)."""

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors as allocated (their bytes are what the payload holds)."""

    def nbytes(self) -> int: ...

    def shared_tensors(self) -> list[torch.Tensor]:
        """Tables the payload reads that belong to the model, not to this cache (CommVQ's codebooks): counted apart
        from nbytes(), once per model (KVPressCache.shared_nbytes)."""

    def offloaded_nbytes(self) -> int:
        """Bytes kept outside memory (a file tier), not in nbytes()."""

    def check(self, where: str, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Refuse (ValueError naming the field under `where`) what a model of this shape and dtype never stores: the
        payload of a file, read before anything is built from it. (b, h) = (batch, heads) of its per-slot tensors."""


@dataclass
class FullPrecision:
    """Keys/values [b, h, t, D] in the model's dtype. `room` (keys, values buffers with spare slots) is set when
    this payload allocated its own buffers: keys/values are then their filled prefix."""

    low_bit: ClassVar[bool] = False
    storage_kind: ClassVar[str | None] = None

    keys: torch.Tensor
    values: torch.Tensor
    room: tuple | None = None

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def batch_heads(self) -> tuple[int, int]:
        return self.keys.shape[0], self.keys.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def key_dtype(self) -> torch.dtype:
        return self.keys.dtype

    def detach(self) -> "FullPrecision":
        """The same tensors without the right to append in place (the buffer may be shared)."""
        return FullPrecision(self.keys, self.values)

    @staticmethod
    def spare_slots(n: int) -> int:
        """Room added when a one-token append outgrows the buffer: amortised O(1) copies per token."""
        return max(64, n // 16)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> "FullPrecision":
        """One-token appends write in place into spare room (grown by a 16th, at least 64 slots, when full), so
        decoding does not copy the layer per token; multi-token appends allocate exactly."""
        filled, need = self.num_slots, self.num_slots + keys.shape[2]
        room = self.room
        if room is not None and room[0].shape[2] >= need:
            room[0][:, :, filled:need] = keys
            room[1][:, :, filled:need] = values
        else:
            capacity = need + (self.spare_slots(need) if keys.shape[2] == 1 else 0)
            room = tuple(_grown(old, new, capacity) for old, new in ((self.keys, keys), (self.values, values)))
        return FullPrecision(room[0][:, :, :need], room[1][:, :, :need], room)

    def reserve(self, n: int) -> "FullPrecision":
        """Room for n more slots, in an owned buffer (grown once, exactly, if needed)."""
        if self.room is not None and self.room[0].shape[2] >= self.num_slots + n:
            return self
        room = tuple(_grown(t, t[:, :, :0], self.num_slots + n) for t in (self.keys, self.values))
        return FullPrecision(room[0][:, :, :self.num_slots], room[1][:, :, :self.num_slots], room)

    def trim(self, spare: int) -> "FullPrecision":
        """The same slots in an owned buffer with exactly `spare` slots of room (a copy, if the room differs)."""
        if self.room is not None and self.room[0].shape[2] == self.num_slots + spare:
            return self
        return self.reserve(spare) if self.room is None else FullPrecision(self.keys, self.values).reserve(spare)

    def truncate(self, n: int) -> "FullPrecision":
        """The first n slots. In an owned buffer the view just shrinks (the rest becomes spare room); anything
        else is cloned: a view would keep the whole old tensor alive and nbytes() would under-report it."""
        if self.room is not None:
            return FullPrecision(self.room[0][:, :, :n], self.room[1][:, :, :n], self.room)
        return FullPrecision(self.keys[:, :, :n].clone(), self.values[:, :, :n].clone())

    def gather(self, indices: torch.Tensor, real: torch.Tensor | None = None) -> "FullPrecision":
        return FullPrecision(take_slots(self.keys, indices), take_slots(self.values, indices))

    def cat(self, other: "FullPrecision") -> "FullPrecision":
        return FullPrecision(torch.cat([self.keys, other.keys], 2), torch.cat([self.values, other.values], 2))

    def map_rows(self, fn) -> "FullPrecision":
        return FullPrecision(fn(self.keys), fn(self.values))

    def flatten(self, ok: torch.Tensor) -> "FullPrecision":
        """The slots where ok [b, h, t] as one flat store [1, 1, N, D], in (row, head, slot) order."""
        return FullPrecision(self.keys[ok][None, None], self.values[ok][None, None])

    def dequantize(self, start: int, end: int, precision: int | None = None):
        return self.keys[:, :, start:end].float(), self.values[:, :, start:end].float()

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        return self.keys  # as stored, in the model's dtype: no copy

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.values

    def to(self, device) -> "FullPrecision":
        return FullPrecision(self.keys.to(device), self.values.to(device))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors as allocated: the buffers with their spare room, if any."""
        return list(self.room) if self.room is not None else [self.keys, self.values]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def shared_tensors(self) -> list[torch.Tensor]:
        return []

    def offloaded_nbytes(self) -> int:
        return 0

    def check(self, where: str, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        checked.tensor(self.keys, f"{where}.keys", dtype, (batch, heads, None, head_dim), finite=True)
        checked.tensor(self.values, f"{where}.values", dtype, (batch, heads, self.num_slots, head_dim), finite=True)


def _grown(old: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
    batch, heads, filled, dim = old.shape
    buffer = old.new_empty(batch, heads, capacity, dim)
    buffer[:, :, :filled] = old
    buffer[:, :, filled:filled + new.shape[2]] = new
    return buffer
