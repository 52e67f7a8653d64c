"""Overwriting stored tokens in place: the keys and values of tokens a forward computes again (CacheBlend's
recompute, kvpress/combined.py), written over the slots that hold those tokens, nothing appended.

A forward whose ForwardState carries `recompute` positions [n] hands each kvpress layer the tokens at those
positions (input ids at their original RoPE positions); `overwrite` finds, in every full-precision segment, the slots
whose position is one of them and overwrites their keys and values. A head that did not keep a token keeps not
having it. Low-bit codes are not rewritten (a recompute would have to re-encode them): refused.
"""

from __future__ import annotations

import torch


def overwrite(layer, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Overwrite the stored keys/values of the tokens at `positions` [n] (increasing) with keys/values
    [B, Hkv, n, D] of this forward, in place."""
    if any(s.low_bit for s in layer.segments):
        raise ValueError("recompute: this layer stores low-bit codes, which a recompute would re-encode; allowed: "
                         "contexts stored in full precision")
    positions = positions.to(layer.device).long()
    batch, heads = layer.batch_heads
    for segment, offset in zip(layer.segments, layer.offsets()):
        if segment.num_slots == 0:
            continue
        if segment.flat:  # one store [1, 1, N] of per-(row, head) runs
            slot_positions = segment.positions[0, 0].long()
            owner = torch.repeat_interleave(torch.arange(segment.lengths.numel(), device=layer.device),
                                            segment.lengths.flatten())
            rows, heads_of = owner // heads, owner % heads
        else:
            slot_positions = segment.view_positions(offset, batch, heads, layer.device).long()
        at = torch.searchsorted(positions, slot_positions).clamp(max=positions.numel() - 1)
        hit = positions[at] == slot_positions
        if segment.valid is not None:
            hit = hit & segment.valid
        data = segment.data
        for stored, new in ((data.keys, keys), (data.values, values)):
            if segment.flat:
                source = new[rows, heads_of, at]  # [N, D]
                stored[0, 0] = torch.where(hit[:, None], source.to(stored.dtype), stored[0, 0])
            else:
                source = new.gather(2, at[..., None].expand(-1, -1, -1, new.shape[-1]))
                stored.copy_(torch.where(hit[..., None], source.to(stored.dtype), stored))
    layer.derived = {}
    layer.mark_changed()
