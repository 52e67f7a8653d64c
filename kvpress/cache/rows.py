"""Layers built from parts: rows of one batch from single-row layers (KVPressCache.stack: eval configs prefilled
alone, decoded together), and a layer holding tokens read back from elsewhere (`holding`: an engine's pages)."""

from __future__ import annotations

import torch

from .layer import KVPressLayer
from .payloads import FullPrecision
from .segments import Segment, empty_tail
from .shadow import SHADOW
from .view import flat_full_precision


def stack_rows(layers: list[KVPressLayer]) -> KVPressLayer:
    """Rows of one batch from single-row layers that have seen the same tokens. Rectangular layers are
    left-padded to the widest with invalid slots (sorted order holds: fillers sit at position 0); if any
    layer is flat, every layer's tokens go flat and the runs are concatenated (no padding). Low-bit layers
    cannot be stacked."""
    if len(layers) == 1:
        return layers[0].fork()
    if len({l.seen for l in layers}) != 1:
        raise ValueError(f"stack: rows of one batch must have seen the same tokens; got {[l.seen for l in layers]}")
    if any(l.codes for l in layers):
        raise ValueError("stack: layers holding low-bit codes cannot be stacked as rows; decode them alone")
    if any(s.kind == SHADOW for l in layers for s in l.segments):
        raise ValueError("stack: layers holding ShadowKV's tiers cannot be stacked as rows; decode them alone")
    first = layers[0]
    out = KVPressLayer()
    out.is_initialized, out.dtype, out.device = True, first.dtype, first.device
    out.seen, out.last_q_len = first.seen, first.last_q_len
    out.rollback_floor = max(l.rollback_floor for l in layers)
    out.explicit_positions = True
    out.sorted = all(l.sorted for l in layers)
    names = sorted({n for l in layers for s in l.segments for n in s.state})
    if any(l.is_flat for l in layers):
        flats = [flat_full_precision(l, names) for l in layers]
        seg = Segment(FullPrecision(torch.cat([f.data.keys for f in flats], 2),
                                    torch.cat([f.data.values for f in flats], 2)),
                      torch.cat([f.positions for f in flats], -1),
                      state={n: torch.cat([f.state[n] for f in flats], -1) for n in names},
                      lengths=torch.cat([f.lengths for f in flats]))
        out.segments = [seg]
        out.segments.append(empty_tail(seg, first.device))
    else:
        width = max(l.view_width for l in layers)
        pads = [width - l.view_width for l in layers]
        pad = torch.nn.functional.pad
        keys = torch.cat([pad(l.keys_view(), (0, 0, p, 0)) for l, p in zip(layers, pads)])
        values = torch.cat([pad(l.values_view(), (0, 0, p, 0)) for l, p in zip(layers, pads)])
        positions = torch.cat([pad(l.key_positions(), (p, 0)) for l, p in zip(layers, pads)])
        valid = torch.cat([pad(l.key_valid(), (p, 0), value=False) for l, p in zip(layers, pads)])
        batch_heads = (1, first.num_kv_heads)
        state = {n: torch.cat([pad(l.get_state(n) if l.get_state(n) is not None else
                                   torch.zeros(*batch_heads, l.view_width, device=first.device), (p, 0))
                               for l, p in zip(layers, pads)]) for n in names}
        out.segments = [Segment(FullPrecision(keys, values), positions, valid, state)]
    if all(l.row_budget is not None for l in layers):
        out.row_budget = torch.cat([l.row_budget for l in layers])
    if any(l.padding is not None for l in layers):
        out.padding = torch.cat([l.padding if l.padding is not None else
                                 torch.zeros(l.key_positions().shape[0], dtype=torch.long, device=first.device)
                                 for l in layers])
    out.policy_stats = {name: torch.cat([l.policy_stats[name] for l in layers]) for name in first.policy_stats
                 if all(name in l.policy_stats for l in layers)}
    if len({l.decode_start for l in layers}) == 1:
        out.decode_start = first.decode_start
    return out


def holding(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, *, seen: int, new_tokens: int,
            row_budget: int, decode_start: int, state: dict | None = None, stats: dict | None = None) -> KVPressLayer:
    """A layer holding tokens kept elsewhere (an engine's pages, read back) as a decode step left them: keys /
    values [B, Hkv, T, D] with each slot's original position [B, Hkv, T] (every head's increasing) and per-slot
    policy state {name: [B, Hkv, T]}, `seen` tokens seen, the newest `new_tokens` of them this step's, the budget
    the prompt's cut fixed (`row_budget`, per row), where generation began (`decode_start`), and the policy's
    per-layer statistics (`stats`, batch-first)."""
    layer = KVPressLayer()
    layer.update(keys, values)
    layer.segments = [Segment(layer.tail.data, positions.to(torch.int32), state=dict(state or {}))]
    layer.explicit_positions = True
    layer.seen = layer.appended = seen
    layer.last_q_len = new_tokens
    layer.row_budget = torch.full((keys.shape[0],), row_budget, dtype=torch.long, device=keys.device)
    layer.decode_start = decode_start
    layer.policy_stats = dict(stats or {})
    return layer
