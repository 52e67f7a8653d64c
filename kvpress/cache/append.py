"""Appending tokens to a layer's tail the plain way (eager code; a prepared room appends by index, room.py): the
tail's keys/values append in place into their spare room, its positions, validity and per-slot state by
concatenation, and the layer's counters move."""

from __future__ import annotations

import torch

from .segments import Segment


def to_tail(layer, key_states: torch.Tensor, value_states: torch.Tensor, new_valid: torch.Tensor | None) -> None:
    """Append q_len tokens [B, Hkv, q_len, D]; `new_valid` [B, q_len] marks which are real (not padding)."""
    batch, heads, q_len, _ = key_states.shape
    tail = layer.tail
    positions = tail.positions
    if layer.explicit_positions:
        new_pos = torch.arange(layer.seen, layer.seen + q_len, device=layer.device, dtype=torch.int32)
        positions = torch.cat([positions, new_pos.expand(batch, heads, q_len)], -1)
    valid = tail.valid
    has_padding = new_valid is not None and not bool(new_valid.all())
    if has_padding:
        missing = (~new_valid.to(dtype=torch.bool)).sum(-1).to(layer.device)
        layer.padding = missing if layer.padding is None else layer.padding + missing
    if new_valid is not None and (valid is not None or has_padding):
        if valid is None:
            valid = torch.ones(batch, heads, tail.num_slots, dtype=torch.bool, device=layer.device)
        new_valid = new_valid.to(device=layer.device, dtype=torch.bool)[:, None, :].expand(batch, heads, q_len)
        valid = torch.cat([valid, new_valid], -1)
    elif valid is not None:
        valid = torch.cat([valid, valid.new_ones(batch, heads, q_len)], -1)
    state = {name: torch.cat([s, s.new_zeros(batch, heads, q_len)], -1) for name, s in tail.state.items()}
    layer.segments[-1] = Segment(tail.data.append(key_states, value_states), positions, valid, state)
    layer.seen += q_len
    layer.appended += q_len
    layer.last_q_len = q_len
