"""Slot rows: every per-slot tensor kvpress stores is [B, H, T, ...] with the slot axis at dim 2, whatever it holds
(keys and values in full precision, bit-packed codes, a per-slot channel list), so keeping some slots is one row
gather over that axis."""

from __future__ import annotations

import torch


def take_slots(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor[b, h, indices[b, h, t]] as a new [B, H, T', D] tensor. Whole D-rows are copied by one flat
    index_select over the storage (a gather with indices expanded over D reads an index per element and is
    about 5x slower); `tensor` may be the filled prefix of a larger buffer."""
    batch, heads, _, dim = tensor.shape
    if dim == 0:  # e.g. no value outliers per slot
        return tensor.new_empty(batch, heads, indices.shape[-1], 0)
    if tensor.stride(-1) != 1 or tensor.stride(-2) != dim or any(
            n % dim for n in (tensor.stride(0), tensor.stride(1), tensor.storage_offset())):
        tensor = tensor.contiguous()
    rows = tensor.as_strided((tensor.untyped_storage().nbytes() // (tensor.element_size() * dim), dim), (dim, 1), 0)
    first = (tensor.storage_offset()
             + torch.arange(batch, device=indices.device)[:, None, None] * tensor.stride(0)
             + torch.arange(heads, device=indices.device)[None, :, None] * tensor.stride(1)) // dim
    return rows.index_select(0, (indices + first).flatten()).view(batch, heads, indices.shape[-1], dim)
