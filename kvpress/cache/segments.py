"""Storage segments: the parts a KVPressLayer is made of, oldest slots first.

A segment holds a run of slots per (row, KV head) and shows the layer one padded view of them, [B, Hkv, W]:
original positions, validity (padding, filler slots), per-slot policy state, and keys/values for scoring and
attention. Two choices make a segment:

  layout   rectangular  every (row, head) has the same W slots; tensors [B, Hkv, W, ...]
           flat         each (row, head) owns one contiguous run of a shared store, in (row, head, position)
                        order, `lengths` [B, Hkv] long; tensors [1, 1, N, ...] with N = lengths.sum(): no
                        padding, so the bytes held are exactly the tokens kept (heads that keep different counts)
  payload  FullPrecision (keys/values as computed) or LowBitCodes (KIVI/GEAR codes): one protocol, `Payload`
           (payloads.py), so a segment never asks which kind it holds

Every per-slot tensor has the slot axis at dim 2, in both layouts, so one gather serves both. A segment is a
value: operations return new segments and never write into tensors they share with another segment, except
`FullPrecision.append`, which writes one-token appends into spare room that the payload allocated itself (and
that copies give up, see `detach`). Which segments a layer may hold, and in which order, is decided by the layer
(layer.py; eviction.compact and flush.py make the layouts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..kernels.sparse_attention import run_grid
from .payloads import FullPrecision, Payload


# storage kinds: (low_bit, flat) -> the name a reader keys its kernel by
DENSE, FLAT, CODES, FLAT_CODES = "dense", "flat", "codes", "flat codes"
KINDS = {(False, False): DENSE, (False, True): FLAT, (True, False): CODES, (True, True): FLAT_CODES}


@dataclass
class Segment:
    data: Payload  # per-slot tensors [b, h, t, ...]
    positions: torch.Tensor | None = None  # int32 [b, h, t]; None: slot j holds position offset + j
    valid: torch.Tensor | None = None  # bool [b, h, t]; None: every slot is a real token (always None when flat)
    state: dict = field(default_factory=dict)  # name -> [b, h, t] per-slot policy state
    lengths: torch.Tensor | None = None  # flat layout: [B, Hkv] run length of each (row, head); None: rectangular

    # -- shape
    @property
    def flat(self) -> bool:
        return self.lengths is not None

    @property
    def low_bit(self) -> bool:
        return self.data.low_bit

    @property
    def kind(self) -> str:
        """The storage kind, which picks a segment's kernel (read.py): DENSE, FLAT, CODES or FLAT_CODES, or the
        payload's own (ShadowKV's, shadow.py)."""
        return self.data.storage_kind or KINDS[self.low_bit, self.flat]

    @property
    def num_slots(self) -> int:
        return self.data.num_slots

    @property
    def width(self) -> int:
        """Slots of the padded view: the longest run when flat."""
        if not self.flat:
            return self.num_slots
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def starts(self) -> torch.Tensor:
        """[B, Hkv] offset of each run in the flat store."""
        flat = self.lengths.flatten()
        return (flat.cumsum(0) - flat).view_as(self.lengths)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat layout: (indices [B, Hkv, W] into the store, ok [B, Hkv, W]); entries past a run are clamped to a
        real slot and marked not ok."""
        return run_grid(self.starts(), self.lengths, self.width, self.num_slots)

    # -- the padded view
    def view(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """A per-slot tensor [b, h, t, ...] as the padded view [B, Hkv, W, ...] (a transient copy when flat)."""
        if not self.flat:
            return tensor
        indices, ok = self.grid()
        if tensor.shape[2] == 0:
            return tensor.new_full((*ok.shape, *tensor.shape[3:]), fill)
        out = tensor[0, 0][indices]
        mask = ok.view(*ok.shape, *([1] * (tensor.dim() - 3)))
        return torch.where(mask, out, torch.as_tensor(fill, dtype=tensor.dtype, device=tensor.device))

    def view_positions(self, offset: int, batch: int, heads: int, device) -> torch.Tensor:
        if self.positions is None:
            return torch.arange(offset, offset + self.num_slots, device=device, dtype=torch.int32).expand(
                batch, heads, self.num_slots)
        return self.view(self.positions)

    def view_valid(self, batch: int, heads: int, device) -> torch.Tensor:
        if self.flat:
            return self.grid()[1]
        if self.valid is None:
            return torch.ones(batch, heads, self.num_slots, dtype=torch.bool, device=device)
        return self.valid

    def padded(self, offset: int, batch: int, heads: int, device) -> tuple:
        """(keys, values, positions, valid) of a full-precision segment in its padded view [B, Hkv, W(, D)]; slots
        past a flat run hold some real slot's data and are not valid (a transient copy when flat)."""
        if not self.flat:
            return (self.data.keys, self.data.values, self.view_positions(offset, batch, heads, device),
                    self.view_valid(batch, heads, device))
        indices, ok = self.grid()
        return (self.data.keys[0, 0][indices], self.data.values[0, 0][indices], self.positions[0, 0][indices], ok)

    def view_state(self, name: str, batch: int, heads: int, device) -> torch.Tensor:
        if name in self.state:
            return self.view(self.state[name])
        return torch.zeros(batch, heads, self.width, device=device)

    def with_view_state(self, name: str, padded: torch.Tensor) -> "Segment":
        """A copy whose per-slot state `name` is `padded` [B, Hkv, W]."""
        flat_state = padded[self.grid()[1]][None, None] if self.flat else padded
        return dataclasses.replace(self, state={**self.state, name: flat_state})

    def counts(self) -> torch.Tensor:
        """[B, Hkv] real tokens of each (row, head)."""
        if self.flat:
            return self.lengths
        if self.valid is None:
            b, h = self.data_shape()
            return torch.full((b, h), self.num_slots, dtype=torch.long, device=self.data.device)
        return self.valid.sum(-1)

    def data_shape(self) -> tuple[int, int]:
        return self.data.batch_heads

    # -- changes (each returns a new segment)
    def keep(self, indices: torch.Tensor, ok: torch.Tensor | None, offset: int) -> "Segment":
        """Keep slots `indices` [B, Hkv, K] of the padded view, sorted per head; `ok` [B, Hkv, K] False marks
        filler entries (kept only to stay rectangular: invalid; dropped when flat). Positions materialise."""
        if self.flat:
            grid, _ = self.grid()
            real = torch.ones_like(indices, dtype=torch.bool) if ok is None else ok
            chosen = grid.gather(-1, indices)[real][None, None]  # (row, head, position) order
            return Segment(self.data.gather(chosen), self.positions.gather(-1, chosen),
                           state={n: s.gather(-1, chosen) for n, s in self.state.items()}, lengths=real.sum(-1))
        batch, heads = indices.shape[:2]
        positions = self.view_positions(offset, batch, heads, indices.device).gather(-1, indices)
        valid = None if self.valid is None else self.valid.gather(-1, indices)
        if ok is not None and not bool(ok.all()):
            valid = ok if valid is None else valid & ok
        return Segment(self.data.gather(indices, ok), positions, valid,
                       {n: s.gather(-1, indices) for n, s in self.state.items()})

    def to_flat(self, offset: int) -> "Segment":
        """The same real tokens in the flat layout (fillers and padding dropped)."""
        if self.flat:
            return self
        batch, heads = self.data_shape()
        ok = self.view_valid(batch, heads, self.data.device)
        positions = self.view_positions(offset, batch, heads, ok.device)
        return Segment(self.data.flatten(ok), positions[ok][None, None], None,
                       {n: s[ok][None, None] for n, s in self.state.items()}, ok.sum(-1))

    def to_rect(self) -> "Segment":
        """Flat full precision padded back to a rectangle (invalid fillers, the longest run's memory)."""
        if not self.flat:
            return self
        _, ok = self.grid()
        data = FullPrecision(self.view(self.data.keys), self.view(self.data.values))
        return Segment(data, self.view(self.positions), ok, {n: self.view(s) for n, s in self.state.items()})

    def with_states(self, names) -> "Segment":
        """A copy carrying per-slot state for every name in `names` (zeros where this segment has none)."""
        missing = [n for n in names if n not in self.state]
        if not missing:
            return self
        zeros = torch.zeros(*self.data_shape(), self.num_slots, device=self.data.device)
        return dataclasses.replace(self, state={**self.state, **{n: zeros for n in missing}})

    def cat_runs(self, other: "Segment") -> "Segment":
        """Two flat segments as one: each (row, head)'s run of self, then its run of other."""
        names = sorted(set(self.state) | set(other.state))
        self, other = self.with_states(names), other.with_states(names)
        n_self = self.num_slots
        merged_data = self.data.cat(other.data)
        order = _interleave(self.lengths, other.lengths, n_self)
        return Segment(merged_data.gather(order), torch.cat([self.positions, other.positions], -1).gather(-1, order),
                       state={n: torch.cat([self.state[n], other.state[n]], -1).gather(-1, order)
                              for n in self.state},
                       lengths=self.lengths + other.lengths)

    def truncate(self, n: int) -> "Segment":
        """The first n slots (rectangular only)."""
        return Segment(self.data.truncate(n),
                       None if self.positions is None else self.positions[..., :n].clone(),
                       None if self.valid is None else self.valid[..., :n].clone(),
                       {name: s[..., :n].clone() for name, s in self.state.items()})

    def map_rows(self, fn) -> "Segment":
        """A batch-axis op (index_select, repeat_interleave) applied to every row."""
        if not self.flat:
            return Segment(self.data.map_rows(fn), None if self.positions is None else fn(self.positions),
                           None if self.valid is None else fn(self.valid), {n: fn(s) for n, s in self.state.items()})
        grid, ok = self.grid()
        ok = fn(ok)
        chosen = fn(grid)[ok][None, None]
        return Segment(self.data.gather(chosen), self.positions.gather(-1, chosen),
                       state={n: s.gather(-1, chosen) for n, s in self.state.items()}, lengths=ok.sum(-1))

    def to(self, device) -> "Segment":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Segment(self.data.to(device), move(self.positions), move(self.valid),
                       {n: s.to(device) for n, s in self.state.items()}, move(self.lengths))

    def detach(self) -> "Segment":
        """A copy that may be shared: no in-place appends into the payload's buffer from either side."""
        return dataclasses.replace(self, data=self.data.detach(), state=dict(self.state))

    # -- bytes
    def tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self.positions, self.valid, self.lengths) if t is not None]
        return [*self.data.tensors(), *extra, *self.state.values()]

    def kv_nbytes(self) -> int:
        return self.data.nbytes()


def _interleave(a: torch.Tensor, b: torch.Tensor, n_a: int) -> torch.Tensor:
    """[1, 1, N] order into cat(store_a, store_b) that puts, for each (row, head), its run of a then its run of b."""
    la, lb = a.flatten(), b.flatten()
    ends_a, ends_b = la.cumsum(0), lb.cumsum(0)
    # merged slot k comes from slot k + shift of its block: run i's a-block moves right by the b-slots of runs
    # before it, its b-block (from n_a on in the concatenation) left by the a-slots of runs after it
    shift = torch.stack([lb - ends_b, n_a - ends_a], 1).flatten()  # a0 b0 a1 b1 ...
    blocks = torch.stack([la, lb], 1).flatten()
    total = int(ends_a[-1] + ends_b[-1]) if la.numel() else 0
    order = torch.arange(total, device=a.device) + torch.repeat_interleave(shift, blocks, output_size=total)
    return order[None, None]


def empty_tail(like: Segment, device) -> Segment:
    """An empty rectangular tail for a layer whose tokens now live in the flat segment `like` (full precision)."""
    batch, heads = like.lengths.shape
    keys, values = like.data.keys, like.data.values
    return Segment(FullPrecision(keys.new_empty(batch, heads, 0, keys.shape[-1]),
                                 values.new_empty(batch, heads, 0, values.shape[-1])),
                   torch.zeros(batch, heads, 0, dtype=torch.int32, device=device), None,
                   {n: torch.zeros(batch, heads, 0, device=device) for n in like.state})


def dense(keys: torch.Tensor, values: torch.Tensor) -> Segment:
    """A rectangular full-precision segment holding keys/values [B, Hkv, T, D] as given."""
    return Segment(FullPrecision(keys, values))
