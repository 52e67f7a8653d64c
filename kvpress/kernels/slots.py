"""Selections made from per-slot decisions: a read view that decides slot by slot (a mask, or scores and a budget)
hands attention the chosen slot numbers in slot order, ragged counts padded with invalid entries (Selection).

`top_slots` runs sparse_cpu.c's top_slots on CPU where it builds (a quickselect per head, one pass in slot order);
`top_slots_reference` is the same selection in torch (topk, then the mask's slots), ties aside: the kernel takes the
older of tied slots, topk any of them."""

from __future__ import annotations

import torch

from . import sparse_native


def slots_of(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [B, Hkv, K], valid) of the True slots of mask [B, Hkv, T], in slot order, padded to the widest head:
    a selection from a mask (views that decide slot by slot)."""
    count = mask.sum(-1)
    width = int(count.max())
    # each True slot goes to its rank among its head's True slots (a running count: no sort over the view)
    at = torch.where(mask, mask.cumsum(-1) - 1, width)
    slots = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    out = torch.zeros(*mask.shape[:-1], width + 1, dtype=torch.long, device=mask.device)
    return out.scatter_(-1, at, slots)[..., :width], torch.arange(width, device=mask.device) < count[..., None]


def top_slots_reference(scores: torch.Tensor, real: torch.Tensor, budget: int, own_from: int):
    """(indices, valid) as slots_of gives them: per head of scores [B, Hkv, T], its real slots from `own_from` on (the
    step's own tokens) and the `budget` highest-scoring other real slots whose score is finite."""
    width = scores.shape[-1]
    own = torch.arange(width, device=scores.device) >= own_from
    top = scores.masked_fill(~real | own, float("-inf")).topk(min(budget, width), dim=-1)
    # (a budget >= the width also picks the own slots, at -inf: written as not chosen, then own ORed back in)
    chosen = torch.zeros_like(real).scatter_(-1, top.indices, torch.isfinite(top.values)) | own
    return slots_of(chosen & real)


def top_slots(scores: torch.Tensor, real: torch.Tensor, budget: int, own_from: int):
    """top_slots_reference's selection, by sparse_cpu.c on CPU where it builds."""
    batch, heads, width = scores.shape
    if scores.is_cuda or torch.compiler.is_compiling() or sparse_native.library() is None:
        return top_slots_reference(scores, real, budget, own_from)
    s = scores.float().contiguous()
    r = real.contiguous().view(torch.uint8)
    room = max(budget, 0) + width - own_from
    out = torch.zeros(batch * heads, room, dtype=torch.long)  # entries past a head's count stay slot 0
    counts = torch.empty(batch * heads, dtype=torch.long)
    if sparse_native.library().top_slots(s.data_ptr(), r.data_ptr(), batch * heads, width, budget, own_from,
                                         out.data_ptr(), counts.data_ptr(), torch.get_num_threads()):
        raise MemoryError("sparse_cpu.c: top_slots could not allocate its work buffer")
    most = int(counts.max()) if counts.numel() else 0
    return out[:, :most].view(batch, heads, most), torch.arange(most) < counts.view(batch, heads, 1)
