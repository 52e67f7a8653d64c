"""RaggedSegment: the oldest slots of a layer whose heads keep different numbers of tokens, stored flat.

Every (row, KV head) owns one contiguous run of the flat tensors, in (row, head) order, sorted by original
position; `lengths` [B, Hkv] says how long each run is. Nothing is padded: the bytes held are exactly the
tokens kept. Policies and masks that want a rectangle get a transient padded view (`padded`), built on demand
and never stored; attention reads the flat tensors directly through an index grid (`index_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RaggedSegment:
    keys: torch.Tensor  # [N, D]
    values: torch.Tensor  # [N, Dv]
    positions: torch.Tensor  # [N] int32, original position of each slot
    lengths: torch.Tensor  # [B, Hkv] int64, slots of each (row, head); sum == N
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N] per-slot policy state

    @property
    def width(self) -> int:
        """Slots of the longest (row, head): the width of the padded view."""
        return int(self.lengths.max()) if self.lengths.numel() else 0

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]

    def starts(self) -> torch.Tensor:
        """[B, Hkv] offset of each (row, head)'s run in the flat tensors."""
        flat = self.lengths.flatten()
        return (flat.cumsum(0) - flat).view_as(self.lengths)

    def index_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [B, Hkv, W] into the flat tensors, ok [B, Hkv, W]); entries past a head's length are
        clamped to a real slot and marked not ok."""
        rank = torch.arange(self.width, device=self.lengths.device)
        ok = rank < self.lengths[..., None]
        indices = (self.starts()[..., None] + rank).clamp(max=max(self.num_tokens - 1, 0))
        return torch.where(ok, indices, 0), ok

    def padded(self, flat: torch.Tensor, fill=0) -> torch.Tensor:
        """A per-slot tensor [N, ...] as a padded [B, Hkv, W, ...] view (a transient copy)."""
        indices, ok = self.index_grid()
        if flat.shape[0] == 0:
            return flat.new_full((*ok.shape, *flat.shape[1:]), fill)
        out = flat[indices]
        mask = ok.view(*ok.shape, *([1] * (flat.dim() - 1)))
        return torch.where(mask, out, torch.as_tensor(fill, dtype=flat.dtype, device=flat.device))

    @classmethod
    def from_padded(cls, keys, values, positions, ok, state=None) -> "RaggedSegment":
        """Flatten padded [B, Hkv, W, ...] tensors, dropping every slot where ok [B, Hkv, W] is False."""
        return cls(keys[ok], values[ok], positions[ok].to(torch.int32), ok.sum(-1),
                   {name: s[ok] for name, s in (state or {}).items()})

    def map_rows(self, fn) -> "RaggedSegment":
        """Apply a batch-axis op (index_select, repeat_interleave) through the padded view."""
        _, ok = self.index_grid()
        return RaggedSegment.from_padded(fn(self.padded(self.keys)), fn(self.padded(self.values)),
                                         fn(self.padded(self.positions)), fn(ok),
                                         {n: fn(self.padded(s)) for n, s in self.state.items()})

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, self.lengths, *self.state.values()]

    def kv_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
