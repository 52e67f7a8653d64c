"""The low-bit flush of a KVPressLayer (layer.py): moving its oldest full-precision slots into low-bit codes.

A rectangular layer whose rows start their groups together flushes the first n slots of its tail. A flat layer (or
a padded batch whose rows would cut their groups at different places) flushes per head: each (row, head) groups
from its own first token and moves its own count, so a row is quantized as it would be alone; what stays in full
precision is one right-aligned rectangle when the heads of each row keep the same count, else flat runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.slots import take_slots
from .payloads import FullPrecision
from .segments import Segment, empty_tail
from .view import flat_full_precision


def flush_low_bit(layer, residual: int, group: int, encode, partition=None) -> None:
    """Move the oldest full-precision slots into low-bit codes via `encode(keys, values, valid, positions)`
    (rectangular [B, Hkv, n, D], n a multiple of `group`; positions [B, Hkv, n]: the slots' original positions, for a
    codec that stores keys before RoPE), keeping at least `residual` newest slots in full precision
    (per head in a flat layer). Returns nothing; the low-bit segment grows.

    Mixed widths (ZipCache): `partition(keys, values, valid, positions)` splits the n moved slots into shares,
    a list of (take [B, Hkv, n_i] slot indices in slot order, real [B, Hkv, n_i]) with n_i a multiple of
    `group`; `encode` is then a list of encoders, one per share, and share i joins the layer's i-th code segment."""
    layer.sort()  # "oldest" is by position
    if not layer.is_flat:
        # rectangular: the same number of slots in every head (fillers count as slots). Nothing to move here
        # means nothing for a flat flush either (a row's real tokens are at most its slots), so the alignment
        # check below runs once per group of new tokens, not at every decode step.
        n = ((layer.view_width - layer.quantized_len - residual) // group) * group
        if n <= 0:
            return
    if layer.is_flat or (not layer.codes and not _rows_align_to(layer, group)):
        # Flat runs group each row from its own first token and flush its own count, so a row behind padding
        # (or behind the fillers of a row that kept fewer tokens) is quantized as it is alone.
        _flush_flat(layer, residual, group, encode, partition)
        return
    tail = layer.tail
    batch, heads = layer.batch_heads
    valid = tail.view_valid(batch, heads, layer.device)
    # a mixed-width flush gives every moved slot an explicit position (its shares are not runs of the view)
    at = tail.view_positions(layer.tail_start(), batch, heads, layer.device)
    positions = tail.positions if partition is None else at
    # (slices are cloned: a view would keep the tail's whole tensor alive, and nbytes() would under-report it)
    moved = _encoded(encode, partition, tail.data.keys[:, :, :n], tail.data.values[:, :, :n], valid[..., :n],
                     at[..., :n], None if positions is None else positions[..., :n].clone(),
                     None if tail.valid is None else tail.valid[..., :n].clone(),
                     {name: s[..., :n].clone() for name, s in tail.state.items()})
    rest = Segment(FullPrecision(tail.data.keys[:, :, n:].clone(), tail.data.values[:, :, n:].clone()),
                   None if positions is None else positions[..., n:].clone(),
                   None if tail.valid is None else tail.valid[..., n:].clone(),
                   {name: s[..., n:].clone() for name, s in tail.state.items()})
    layer.segments = [*_joined(layer.codes, moved, _cat_rect), rest]
    layer.explicit_positions = layer.explicit_positions or partition is not None
    layer.derived = {}
    layer.mark_changed()


def _encoded(encode, partition, keys, values, valid, at, positions, stored_valid, state) -> list[Segment]:
    """The moved slots (at [B, Hkv, n]: their positions) as code segments: one (in slot order, `stored_valid` /
    `positions` as the tail had them) or, with a partition, one per share (gathered in slot order, explicit
    positions, fillers invalid)."""
    if partition is None:
        return [Segment(encode(keys, values, valid, at), positions, stored_valid, state)]
    shares = partition(keys, values, valid, at)
    if len(shares) != len(encode):
        raise ValueError(f"flush_low_bit: the partition gave {len(shares)} shares for {len(encode)} encoders")
    return [Segment(enc(take_slots(keys, take), take_slots(values, take), real, at.gather(-1, take)),
                    at.gather(-1, take),
                    None if bool(real.all()) else real, {name: s.gather(-1, take) for name, s in state.items()})
            for enc, (take, real) in zip(encode, shares)]


def _joined(codes: list[Segment], moved: list[Segment], join) -> list[Segment]:
    """The layer's code segments with the moved ones behind them, segment i with share i."""
    if not codes:
        return moved
    if len(codes) != len(moved):
        raise RuntimeError(f"flush_low_bit: this layer holds {len(codes)} low-bit segments and the codec flushes "
                           f"{len(moved)}; one codec's widths must stay the same for the whole cache")
    return [join(old, new) for old, new in zip(codes, moved)]


def _cat_rect(old: Segment, new: Segment) -> Segment:
    return Segment(old.data.cat(new.data), _cat(old.positions, new.positions), _cat_valid(old, new),
                   {name: torch.cat([old.state[name], s], -1) for name, s in new.state.items()})


def _rows_align_to(layer, group: int) -> bool:
    """Rectangular groups of `group` slots start at every row's first real token: each row's fillers all lead
    and come in whole groups (no padding at all, or padding that is a multiple of the group)."""
    lead = layer.leading_fillers()
    if lead is None:
        return True
    return bool(((~layer.key_valid()).sum(-1) == lead).all()) and bool((lead % group == 0).all())


def _flush_flat(layer, residual: int, group: int, encode, partition) -> None:
    """Flat layer: each head moves its oldest whole groups, keeping >= residual full-precision tokens."""
    # Most decode steps move nothing (a head flushes once per `group` tokens): after a count that finds nothing
    # to move, nothing is counted again until enough tokens have arrived for the fullest head to fill a group.
    key = ("no flat flush before", residual, group)
    if key in layer.derived and layer.appended < layer.derived[key].appended:
        return
    full_precision = sum(s.counts() for s in layer.segments if not s.low_bit)
    n_move = ((full_precision - residual).clamp(min=0) // group) * group  # [B, Hkv]
    if not bool((n_move > 0).any()):
        layer.derived[key] = _NoFlushBefore(layer.appended + int((residual + group - full_precision).min()))
        return
    if _flush_right_aligned_tail(layer, full_precision, n_move, encode, partition):
        return
    fp = flat_full_precision(layer)
    grid, ok = fp.grid()
    rank = torch.arange(grid.shape[-1], device=grid.device)
    move = ok & (rank < n_move[..., None])
    width = int(n_move.max())
    # Encode the moved tokens per head (groups never span two heads): as a rectangle padded with invalid
    # fillers, which never stretch a group's range, then flattened without them.
    real = move[..., :width]
    at = fp.view(fp.positions)[..., :width]
    moved = _encoded(encode, partition, fp.view(fp.data.keys)[:, :, :width], fp.view(fp.data.values)[:, :, :width],
                     real, at, at, real, {n: fp.view(s)[..., :width] for n, s in fp.state.items()})
    codes = _joined(layer.codes, [m.to_flat(0) for m in moved], Segment.cat_runs)
    keep = ok & ~move
    if _rows_differ_only(keep.sum(-1)):
        # the heads of each row keep the same count (a padded batch: rows differ only by their phase in the
        # group): the window as one rectangle with fillers, like left padding, read in place at every step
        layer.segments = [*codes, _right_aligned(fp, keep)]
    else:  # heads of a row keep different counts (a ragged eviction): flat runs, no fillers
        kept = fp.keep(*_rank_select(keep), 0)
        layer.segments = [*codes, kept, empty_tail(kept, layer.device)]
    layer.explicit_positions = True  # flat runs hold explicit positions, so the tail records its own from now on
    layer.derived = {}
    layer.mark_changed()


def _flush_right_aligned_tail(layer, counts: torch.Tensor, n_move: torch.Tensor, encode, partition) -> bool:
    """_flush_flat's steady state, [flat codes (a segment per width), a tail whose real slots end every head
    (leading fillers)], as a previous flush left it: each head's oldest tokens are the tail's first real slots,
    so the moved tokens are gathered straight from the tail, and what stays is the tail's last slots (a copy, no
    gather). The same codes and the same tokens kept as the general path. False, changing nothing, for any other
    layout."""
    codes = layer.segments[:-1]
    if not codes or not all(s.low_bit and s.flat for s in codes) or layer.tail.flat:
        return False
    tail = layer.tail
    total = tail.num_slots
    slots = torch.arange(total, device=counts.device)
    lead = total - counts
    leading_fillers_only = (not bool((lead != 0).any())) if tail.valid is None else torch.equal(
        tail.valid, slots >= lead[..., None])
    if not leading_fillers_only:
        return False
    kept = counts - n_move
    if not _rows_differ_only(kept):
        return False
    keep_width = int(kept.max())
    width = int(n_move.max())
    rank = slots[:width]
    at = (lead[..., None] + rank).clamp(max=max(total - 1, 0))  # [B, H, width]: the oldest real slots
    real = rank < n_move[..., None]
    positions = tail.view_positions(0, *layer.batch_heads, layer.device)
    moved_positions = positions.gather(-1, at)
    moved = _encoded(encode, partition, take_slots(tail.data.keys, at), take_slots(tail.data.values, at), real,
                     moved_positions, moved_positions, real, {n: s.gather(-1, at) for n, s in tail.state.items()})
    stay = slice(total - keep_width, total)
    valid = slots[stay] >= (lead + n_move)[..., None]
    layer.segments = [*_joined(codes, [m.to_flat(0) for m in moved], Segment.cat_runs), Segment(
        FullPrecision(tail.data.keys[:, :, stay].clone(), tail.data.values[:, :, stay].clone()),
        torch.where(valid, positions[..., stay], 0),
        None if bool(valid.all()) else valid, {n: s[..., stay].clone() for n, s in tail.state.items()})]
    layer.derived = {}
    layer.mark_changed()
    return True


def _cat(a, b):
    return None if a is None and b is None else torch.cat([a, b], -1)


def _cat_valid(a: Segment, b: Segment):
    if a.valid is None and b.valid is None:
        return None
    batch, heads = a.data_shape()
    return torch.cat([a.view_valid(batch, heads, a.valid.device if a.valid is not None else b.valid.device),
                      b.view_valid(batch, heads, b.valid.device if b.valid is not None else a.valid.device)], -1)


@dataclass
class _NoFlushBefore:
    """Derived state (layer.derived) of a flat flush: no head can fill a group to move before `layer.appended`
    reaches this. An append adds at most one token per head per token appended; every other change (eviction,
    rollback, forgetting observers) only removes tokens, or restructures the layer and drops aux."""

    appended: int

    def truncate(self, n: int) -> None:  # a rollback removes tokens: the bound stays safe
        pass


def _rows_differ_only(counts: torch.Tensor) -> bool:
    """Every row's heads hold the same count [B, Hkv] (rows may differ from each other, as left padding does)."""
    return bool((counts == counts[:, :1]).all())


def _right_aligned(flat: Segment, keep: torch.Tensor) -> Segment:
    """The slots of the flat segment's padded view where keep [B, H, W] as one rectangular segment whose rows
    end together: each (row, head)'s kept slots, in order, at the right end, behind leading invalid fillers (as
    a left-padded row; fillers sit at position 0). What a flat flush leaves in full precision when rows differ
    only from each other: the window is then read in place at every step instead of being gathered from runs."""
    count = keep.sum(-1)
    width = int(count.max()) if count.numel() else 0
    order, _ = _rank_select(keep)
    rank = torch.arange(width, device=keep.device) - (width - count)[..., None]
    real = rank >= 0
    slots = flat.grid()[0].gather(-1, order.gather(-1, rank.clamp(min=0)))  # [B, H, width] into the store
    data = FullPrecision(flat.data.keys[0, 0][slots], flat.data.values[0, 0][slots])  # as Segment.padded reads
    return Segment(data, torch.where(real, flat.positions[0, 0][slots], 0),
                   None if bool(real.all()) else real, {n: s[0, 0][slots] for n, s in flat.state.items()})


def _rank_select(mask: torch.Tensor):
    """(indices, ok) of the True entries of mask [B, H, W], per head, in order, padded to the widest head."""
    count = mask.sum(-1)
    width = int(count.max()) if count.numel() else 0
    order = (~mask).long().argsort(dim=-1, stable=True)[..., :width]
    ok = torch.arange(width, device=mask.device) < count[..., None]
    return order, ok
