"""Eviction in a KVPressLayer (layer.py): compacting the layer to the slots a policy keeps, sorting after an
in-place eviction, the in-place eviction itself (replace_newest), padding a flat layer back into a rectangle, and
replacing every slot by synthesised ones (rewrite: FreqKV's frequency-domain merge of old tokens).

The layout rule lives here, in one place (`compact`): a keep that leaves the heads of a row with different counts
makes the layer flat unless it holds rectangular low-bit codes (then heads get invalid filler slots); a flat layer
stays flat; rows that differ only from each other stay rectangular with fillers.
"""

from __future__ import annotations

import torch

from .payloads import FullPrecision
from .segments import Segment, empty_tail


def compact(layer, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
    """keep() without marking a change: for what keeps the same tokens (sorting) or rolls back (crop)."""
    batch, heads = layer.batch_heads
    if indices.dim() != 3 or indices.shape[:2] != (batch, heads):
        raise ValueError(f"keep: indices must be [B={batch}, Hkv={heads}, T'], got {tuple(indices.shape)}")
    if layer.sorted:
        indices, order = indices.sort(dim=-1)  # slot order is position order
    else:  # a tail whose slots were replaced in place: put them back in position order
        order = _position_order(layer).gather(-1, indices).argsort(dim=-1, stable=True)
        indices = indices.gather(-1, order)
    if keep_valid is not None:
        keep_valid = keep_valid.gather(-1, order)
    parts = _split(layer, indices, keep_valid)
    offsets = layer.offsets()
    codes = layer.codes  # lead the layer: segment i is parts[i]
    kept = [segment.keep(*parts[i], offsets[i]) for i, segment in enumerate(codes)]
    full = [(s, parts[i], offsets[i]) for i, s in enumerate(layer.segments) if not s.low_bit]
    real = layer.key_valid().gather(-1, indices)
    if keep_valid is not None:
        real = real & keep_valid
    counts = real.sum(-1)
    goes_flat = all(c.flat for c in codes) and (
        layer.is_flat or bool((counts != counts[:, :1]).any()))
    if goes_flat:
        flat = None
        for segment, (idx, ok), offset in full:
            part = segment.keep(idx, ok, offset).to_flat(offset)
            flat = part if flat is None else flat.cat_runs(part)
        kept += [flat, empty_tail(flat, layer.device)]
    else:
        (segment, (idx, ok), offset), = full  # rectangular: the tail is the only full-precision segment
        kept.append(segment.keep(idx, ok, offset))
    layer.segments = kept
    layer.explicit_positions = True
    layer.sorted = True
    layer.derived = {}


def _split(layer, indices: torch.Tensor, keep_valid: torch.Tensor | None):
    """Per segment: (slot indices relative to the segment [B, Hkv, K_s], ok [B, Hkv, K_s]); each head's kept
    slots of a segment are a contiguous range of the sorted index list, padded with filler entries."""
    out, offset = [], 0
    width = indices.shape[-1]
    valid = torch.ones_like(indices, dtype=torch.bool) if keep_valid is None else keep_valid
    for segment in layer.segments:
        inside = (indices >= offset) & (indices < offset + segment.width)
        first = (indices < offset).sum(-1)
        count = inside.sum(-1)
        rank = torch.arange(int(count.max()) if count.numel() else 0, device=indices.device)
        at = (first[..., None] + rank).clamp(max=max(width - 1, 0))
        ok = rank < count[..., None]
        idx = torch.where(ok, indices.gather(-1, at) - offset, 0) if width else at
        out.append((idx, (ok & valid.gather(-1, at)) if width else ok))
        offset += segment.width
    return out


def _position_order(layer) -> torch.Tensor:
    """[B, Hkv, T] keys whose order is position order: in-place eviction mixes only the tail, so every slot
    before it keeps its place, and the tail's slots rank by position, its fillers first (where a flush's
    window and left padding hold them)."""
    start = layer.tail_start()
    tail = layer.key_positions(start).long().masked_fill(~layer.key_valid(start), -1)
    before = torch.arange(start, device=tail.device) - start - 1  # below every tail key, in slot order
    return torch.cat([before.expand(*tail.shape[:2], start), tail], -1)


def sort(layer) -> None:
    """Put every head's slots back in position order (one copy), if an in-place eviction mixed them."""
    if not layer.sorted:
        valid = layer.key_valid()
        order = _position_order(layer).argsort(dim=-1, stable=True)
        layer.compact(order, valid.gather(-1, order))


def replace_newest(layer, victims: torch.Tensor) -> bool:
    """Evict one slot per (row, KV head) without copying the layer: the newest slot (the tail's last, just
    appended) is written into `victims` [B, Hkv] (a victim that is the newest slot itself is simply dropped),
    and the tail shrinks by one. Slots then no longer follow position order. Returns False, changing nothing,
    when the storage cannot do it in place (a victim outside the full-precision tail, a flat tail, or a buffer
    this layer does not own). Earlier segments (flat runs, low-bit codes) may precede the tail: decode_budget
    evicts generated tokens, which all sit in the tail."""
    if layer.tail.flat or layer.tail.data.room is None or layer.tail.num_slots < 2:
        return False
    offset = layer.tail_start()
    if bool((victims < offset).any()):
        return False
    victims = victims - offset
    tail = layer.tail
    batch, heads = layer.batch_heads
    last = tail.num_slots - 1
    # (row, head) pairs flattened: the newest slot is written onto the victim's, a no-op where they coincide
    flat = torch.arange(batch * heads, device=victims.device)
    target = victims.reshape(-1)

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        """A per-slot tensor [B, H, T(, ...)] with its newest slot moved to the victims and cut off."""
        out = tensor.clone()
        rows = out.view(batch * heads, tensor.shape[2], *tensor.shape[3:])
        rows[flat, target] = rows[:, last].clone()
        return out[:, :, :last].clone()

    for buffer in tail.data.room:  # keys, values: in place, in the layer's own buffer
        rows = buffer.view(batch * heads, buffer.shape[2], buffer.shape[3])
        rows[flat, target] = rows[:, last].clone()
    positions = tail.view_positions(0, batch, heads, layer.device)
    # a layer that evicts in place needs one spare slot for the next token: the growth room of appends goes
    # (one copy, the first time), so the bytes held stay at budget + 1 slot
    layer.segments[-1] = Segment(tail.data.truncate(last).trim(1), moved(positions),
                                 None if tail.valid is None else moved(tail.valid),
                                 {name: moved(s) for name, s in tail.state.items()})
    layer.explicit_positions, layer.sorted = True, False
    layer.derived = {}
    layer.mark_changed()
    return True


def to_rectangular(layer) -> None:
    """Pad a flat layer back into one rectangle (invalid filler slots), for readers that index a rectangle
    (read views). Costs the widest head's memory in every head."""
    if not layer.is_flat:
        return
    if layer.codes:
        raise RuntimeError("to_rectangular: a flat layer with low-bit codes cannot be padded back")
    names = {n for s in layer.segments for n in s.state}
    views = (layer.keys_view(), layer.values_view(), layer.key_positions(), layer.key_valid(),
             {n: layer.get_state(n) for n in names})
    layer.segments = [Segment(FullPrecision(views[0], views[1]), views[2], views[3], views[4])]
    layer.derived = {}


def rewrite(layer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            valid: torch.Tensor | None) -> None:
    """Replace every stored slot by new ones, one full-precision rectangle: keys / values [B, Hkv, T, D], positions
    [B, Hkv, T] (each slot's position, in position order per head) and validity (None: all real). For a policy that
    synthesises slots from old ones (FreqKV): per-slot policy state described the old slots and goes; a rollback
    cannot go back before it. Refused over low-bit codes, which the new slots would silently replace."""
    if layer.codes:
        raise RuntimeError("rewrite: a layer holding low-bit codes cannot be rewritten in full precision")
    layer.segments = [Segment(FullPrecision(keys, values), positions.to(torch.int32), valid)]
    layer.room = None
    layer.explicit_positions = True
    layer.sorted = True
    layer.derived = {}
    layer.mark_changed()
