"""The tail's room: what makes a decode step capturable (torch.compile fullgraph, CUDA graphs).

A captured graph replays fixed tensor shapes at fixed addresses and cannot run host code. A layer's tail grows by
one slot per decode step, and its counters (`seen`, the filled slots) are Python ints, so a decode step over the
plain tail changes shape every step. A room reserves the tail's next slots ahead, in buffers the graph keeps:

  keys/values [B, Hkv, C, D], positions int32 [B, Hkv, C], valid bool [B, Hkv, C] and every per-slot state
  [B, Hkv, C], with C = the tail's slots + the reserve; `counters` int64 [2] on the layer's device: (slots filled,
  tokens seen) when the step in flight began.

Each decode forward of a cache with a reserve is split in three (integrations/forwards.py):
  host, before (prepare)   outside any graph: make room for the forward's tokens (grow or rebuild when the tail is
                           not this room's, a growth event) and write the counters;
  device (the step)        traced code sees the tail as the whole room, its unfilled slots invalid (the layer's
                           `segments`), appends by index at counters[0] and reads positions from counters[1]: no
                           Python int that changes per step is read, so the shapes stay the same until the next
                           event;
  host, after (settle)     the layer's Python counters and its exact tail (views of the room's filled slots, what
                           every eager reader sees) catch up; the policy's decode hook (a codec's flush, an
                           evictor's cut) runs here, with the step's Context.
An eager forward on a prepared layer appends into the room the same way and settles at once, so the room stays the
tail's between captured steps. The reserve is counted in nbytes (reserved, not used, as stats() reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .held import tensors_in
from .payloads import FullPrecision
from .segments import Segment


@dataclass
class TailRoom:
    segment: Segment  # the whole room as one rectangular segment (unfilled slots invalid): what traced code reads
    counters: torch.Tensor  # int64 [2] on the layer's device: (filled, seen) when the step in flight began
    filled: int  # slots of the room that hold the tail's tokens
    issued: Segment | None = None  # the layer's exact tail these buffers back (a layer whose tail is another
    #                                segment changed it outside the room: the room is rebuilt before the next step)
    explicit_valid: bool = False  # the exact tail carries a validity tensor (padding, fillers, or a mask was given)
    ready: bool = False  # prepared for the forward in flight (set by prepare, cleared by settle)
    pending: int = 0  # tokens a traced step appended that the host has not counted yet
    changed: bool = False  # the traced step changed earlier slots (per-slot state): a rollback cannot pass it
    context: object = None  # the traced step's policy Context, for the policy's decode hook on the host
    derived: dict = field(default_factory=dict)  # read-side state over the room (a read view's page statistics),
    #                                              built by the policy before a captured step, updated in it
    states: tuple = field(default_factory=tuple)  # names of the per-slot states the room carries

    @property
    def capacity(self) -> int:
        return self.segment.num_slots

    def backs(self, layer) -> bool:
        """The layer's exact tail is this room's (views of its filled slots): nothing changed it outside the room."""
        return self.issued is layer.tail_exact

    def tensors(self) -> list[torch.Tensor]:
        """The room's buffers (reserved slots included), its counters, and the read-side state built over it."""
        return [*self.segment.tensors(), self.counters, *tensors_in(self.derived)]


def prepare(layer, q_len: int, reserve: int, masked: bool) -> None:
    """Before a forward appending q_len tokens (host): a room that backs the layer's tail with space for them, and
    the counters the step reads. `masked`: the forward tells which new tokens are padding (they are counted on the
    device, in a counter that must exist before the step)."""
    if masked and layer.padding is None:
        layer.padding = torch.zeros(layer.batch_heads[0], dtype=torch.long, device=layer.device)
    room = layer.room
    # (a tail whose per-slot states change is a new segment: a room that backs the tail carries its states)
    if room is None or not room.backs(layer) or room.ready or room.filled + q_len > room.capacity:
        room = _rebuild(layer, room, layer.tail_exact, q_len, reserve)
    room.counters.copy_(torch.tensor([room.filled, layer.seen], dtype=torch.long), non_blocking=True)
    room.ready, room.pending = True, 0
    layer.room = room


def _rebuild(layer, old: TailRoom | None, tail: Segment, q_len: int, reserve: int) -> TailRoom:
    """A room holding `tail` in its first slots: the old room's buffers when they fit (the same addresses: a
    captured graph replays), else new ones sized for the tail + q_len + reserve."""
    batch, heads = layer.batch_heads
    n = tail.width
    keys, values = tail.data.keys, tail.data.values
    names = tuple(sorted(tail.state))
    fits = (old is not None and old.capacity >= n + q_len and old.states == names
            and old.segment.data.keys.shape[:2] == keys.shape[:2] and old.segment.data.keys.dtype == keys.dtype)
    if fits:
        segment = old.segment
    else:
        capacity = n + q_len + reserve
        segment = Segment(FullPrecision(keys.new_zeros(batch, heads, capacity, keys.shape[-1]),
                                        values.new_zeros(batch, heads, capacity, values.shape[-1])),
                          torch.zeros(batch, heads, capacity, dtype=torch.int32, device=layer.device),
                          torch.zeros(batch, heads, capacity, dtype=torch.bool, device=layer.device),
                          {name: keys.new_zeros(batch, heads, capacity, dtype=tail.state[name].dtype) for name in names})
    positions = tail.view_positions(layer.tail_start(), batch, heads, layer.device)
    valid = tail.view_valid(batch, heads, layer.device)
    pairs = [(segment.data.keys, keys), (segment.data.values, values), (segment.positions, positions),
             (segment.valid, valid), *((segment.state[name], tail.state[name]) for name in names)]
    for buffer, src in pairs:
        if src.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and \
                src.data_ptr() == buffer.data_ptr():
            continue  # already the room's first slots
        buffer[:, :, :n] = src.to(buffer.dtype)
    segment.valid[:, :, n:] = False
    counters = old.counters if fits else torch.zeros(2, dtype=torch.long, device=layer.device)
    if not fits:  # a CUDA graph writes into these in place, so they must keep their addresses (as StaticCache's)
        for buffer in (*segment.tensors(), counters):
            torch._dynamo.mark_static_address(buffer)
    room = TailRoom(segment, counters, n, states=names, explicit_valid=tail.valid is not None)
    layer.segments[-1] = room.issued = exact_tail(layer, room)
    return room


def append(layer, room: TailRoom, keys: torch.Tensor, values: torch.Tensor, new_valid: torch.Tensor | None):
    """Write q_len new tokens into the room at counters[0], by index (no Python int that changes per step)."""
    batch, heads, q_len, _ = keys.shape
    segment = room.segment
    offsets = torch.arange(q_len, device=keys.device)
    slots = room.counters[0] + offsets
    segment.data.keys.index_copy_(2, slots, keys.to(segment.data.keys.dtype))
    segment.data.values.index_copy_(2, slots, values.to(segment.data.values.dtype))
    positions = (room.counters[1] + offsets).to(torch.int32)
    segment.positions.index_copy_(2, slots, positions.expand(batch, heads, q_len))
    if new_valid is None:
        segment.valid.index_fill_(2, slots, True)
    else:
        real = new_valid.to(device=keys.device, dtype=torch.bool)
        segment.valid.index_copy_(2, slots, real[:, None, :].expand(batch, heads, q_len))
        room.explicit_valid = True
        if layer.padding is not None:  # prepare gives a layer that is told which tokens are padding a counter
            layer.padding.add_((~real).sum(-1).to(layer.padding.dtype))
    for state in segment.state.values():
        state.index_fill_(2, slots, 0.0)
    room.pending = q_len


def settle(layer) -> None:
    """After the forward (host): count what the step appended, and show eager readers the filled slots."""
    room = layer.room
    if room is None or not room.ready:
        return
    q_len, changed = room.pending, room.changed
    room.ready, room.pending, room.changed = False, 0, False
    if not room.backs(layer):
        return  # the forward changed the tail otherwise (an eager policy step): the room is rebuilt next time
    room.filled += q_len
    layer.seen += q_len
    layer.appended += q_len
    if q_len:
        layer.last_q_len = q_len
    layer.segments[-1] = room.issued = exact_tail(layer, room)
    if changed:
        layer.mark_changed()


def exact_tail(layer, room: TailRoom) -> Segment:
    """The tail as eager code sees it: views of the room's filled slots (its keys/values may append in place)."""
    n, segment = room.filled, room.segment
    keys, values = segment.data.keys, segment.data.values
    return Segment(FullPrecision(keys[:, :, :n], values[:, :, :n], (keys, values)),
                   segment.positions[..., :n] if layer.explicit_positions else None,
                   segment.valid[..., :n] if room.explicit_valid else None,
                   {name: s[..., :n] for name, s in segment.state.items()})
