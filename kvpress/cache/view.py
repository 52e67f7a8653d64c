"""The padded view of a KVPressLayer (layer.py) and its per-slot policy state: functions of the layer.

Policies never see segments: they see one view [B, Hkv, T] over all of them, oldest first, the flat part padded to
its longest head with invalid slots. Slot j of that view is what the layer's keep() takes, and what per-slot state
(scores a policy accumulates) is given over.
"""

from __future__ import annotations

import dataclasses

import torch

from .segments import Segment


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-segment views joined along the slot axis (no copy for a layer of one segment)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def segments_from(layer, start: int) -> list[tuple[Segment, int]]:
    """(segment, offset) of the segments from view slot `start` on (a segment boundary: 0, or tail_start())."""
    parts = [(s, o) for s, o in zip(layer.segments, layer.offsets()) if o >= start]
    if not parts or parts[0][1] != start:
        raise ValueError(f"start={start}: not a segment boundary of this layer's view; allowed values: 0, "
                         f"tail_start()")
    return parts


def key_positions(layer, start: int = 0) -> torch.Tensor:
    """int32 [B, Hkv, T]: original position of every slot of the padded view (fillers sit at 0); from slot
    `start` (a segment boundary) on."""
    batch, heads = layer.batch_heads
    return joined([s.view_positions(o, batch, heads, layer.device) for s, o in segments_from(layer, start)])


def key_valid(layer, start: int = 0) -> torch.Tensor:
    """[B, Hkv, T] which slots of the padded view (from slot `start` on) hold real tokens."""
    batch, heads = layer.batch_heads
    return joined([s.view_valid(batch, heads, layer.device) for s, _ in segments_from(layer, start)])


def generated_in_tail(layer) -> bool:
    """Every slot before the full-precision tail is a prompt token, so the generated tokens (positions >=
    decode_start) all sit in the tail, where a decode step can evict one in place."""
    if layer.tail.flat or len(layer.segments) == 1:
        return False
    for segment, offset in zip(layer.segments[:-1], layer.offsets()):
        if segment.num_slots == 0:
            continue
        newest = offset + segment.num_slots - 1 if segment.positions is None else int(segment.positions.max())
        if newest >= layer.decode_start:
            return False
    return True


def leading_fillers(layer) -> torch.Tensor | None:
    """[B, Hkv] slots of the view before each row/head's first real slot (a row's left padding, or the fillers
    of a row that kept fewer tokens than another); None when every slot is real."""
    valid = layer.key_valid_or_none()
    return None if valid is None else (~valid).int().cumprod(-1).sum(-1)


def key_valid_or_none(layer) -> torch.Tensor | None:
    """key_valid(), or None when every slot of the view is a real token (masks can skip the check)."""
    if all(not s.flat and s.valid is None for s in layer.segments):
        return None
    return layer.key_valid()


def view_part(layer, segment: Segment, values: bool, dtype=None) -> torch.Tensor:
    """One segment's keys (or values) in its padded view: full precision as stored; codes as a transient dequantized
    copy in `dtype` (the layer's by default), for policies that score keys (attention never reads this)."""
    dtype = dtype or layer.dtype
    return segment.view(segment.data.readable_values(dtype) if values else segment.data.readable_keys(dtype))


def keys_view(layer) -> torch.Tensor:
    """[B, Hkv, T, D] keys of the padded view (a transient copy unless the layer is one rectangle)."""
    if len(layer.segments) == 1:
        return view_part(layer, layer.tail, values=False)
    return torch.cat([view_part(layer, s, values=False) for s in layer.segments], 2)


def values_view(layer) -> torch.Tensor:
    if len(layer.segments) == 1:
        return view_part(layer, layer.tail, values=True)
    return torch.cat([view_part(layer, s, values=True) for s in layer.segments], 2)


def flat_full_precision(layer, names=()) -> Segment:
    """Every full-precision token of this layer as one flat segment (with per-slot state `names` at least)."""
    flat = None
    for segment, offset in zip(layer.segments, layer.offsets()):
        if not segment.low_bit:
            part = segment.to_flat(offset).with_states(names)
            flat = part if flat is None else flat.cat_runs(part)
    return flat


# ---------------------------------------------------------------------------- per-slot policy state
def get_state(layer, name: str, start: int = 0) -> torch.Tensor | None:
    """Per-slot policy state [B, Hkv, T] over the padded view (from slot `start`, a segment boundary, on), or
    None if the policy never set it."""
    if not any(name in s.state for s in layer.segments):
        return None
    batch, heads = layer.batch_heads
    return joined([s.view_state(name, batch, heads, layer.device) for s, _ in segments_from(layer, start)])


def set_state(layer, name: str, state: torch.Tensor) -> None:
    """Store per-slot policy state given over the padded view [B, Hkv, T]."""
    write_state(layer, name, state)
    layer.mark_changed()


def write_state(layer, name: str, state: torch.Tensor) -> None:
    out = []
    for segment, offset in zip(layer.segments, layer.offsets()):
        out.append(segment.with_view_state(name, state[..., offset:offset + segment.width]))
    layer.segments = out


def add_state(layer, name: str, values: torch.Tensor) -> None:
    """Per-slot state `name` += values [B, Hkv, T] over the padded view (never set: zeros). A layer that is one
    rectangle (every decode-time evictor's, between cuts) adds in one op, without joining and re-slicing."""
    tail = layer.tail
    if layer.captured:  # the room's state buffer, in place (a captured step keeps its tensors)
        if len(layer.segments) != 1 or name not in tail.state:
            raise RuntimeError(f"a captured decode step adds per-slot state {name!r} in place, into a layer of one "
                               f"segment that carries it; this layer has {len(layer.segments)} segments")
        tail.state[name].add_(values.to(tail.state[name].dtype))
        layer.mark_changed()
        return
    if len(layer.segments) == 1 and not tail.flat:
        old = tail.state.get(name)
        summed = values if old is None else old + values
        layer.segments[0] = dataclasses.replace(tail, state={**tail.state, name: summed})
        layer.mark_changed()
        return
    state = layer.get_state(name)
    layer.set_state(name, values if state is None else state + values)


def set_newest_state(layer, name: str, values: torch.Tensor) -> None:
    """Per-slot state `name` of the newest r slots, values [B, Hkv, r] (the tokens just appended: the last r
    slots of a rectangular tail); other slots keep theirs (zeros where never set). Touches the tail only."""
    tail, rows = layer.tail, values.shape[-1]
    if tail.flat or tail.num_slots < rows:  # the newest slots are not the tail's last: through the whole view
        state = layer.get_state(name)
        state = values.new_zeros(layer.key_valid().shape) if state is None else state.clone()
        state[..., -rows:] = values
        write_state(layer, name, state)
        return
    batch, heads = layer.batch_heads
    state = tail.view_state(name, batch, heads, layer.device).to(values.dtype).clone()
    state[..., -rows:] = values
    layer.segments[-1] = dataclasses.replace(tail, state={**tail.state, name: state})


def drop_state(layer, name: str) -> None:
    """Forget per-slot state `name` (a policy that no longer needs it: its bytes are freed)."""
    layer.segments = [dataclasses.replace(s, state={k: v for k, v in s.state.items() if k != name})
                      if name in s.state else s for s in layer.segments]


def tokens_per_head(layer) -> torch.Tensor:
    """[B, Hkv] real tokens kept in each head."""
    return sum(s.counts() for s in layer.segments)
