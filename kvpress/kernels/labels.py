"""Double Sparsity's approximate attention scores over its label cache (each stored key's r label channels per query
head, min-max quantized per (slot, head) to `bits`, packed like KIVI's codes, or fp16 values at 16 bits).

`label_scores` runs sparse_cpu.c's label_scores on CPU where it builds: the packed codes are read in place (a byte's
share of q . codes looked up in a 256-entry table per byte position) and the scale applied once per dot product
(s (q . codes) + min sum(q)), so no fp32 copy of the label cache is written each step. `label_scores_reference` is
the same computation in torch (dequantize, matmul, max over the group)."""

from __future__ import annotations

import torch

from ..formats.lowbit import unpack_floats
from . import sparse_native

Labels = tuple  # (codes uint8 [B, Hq, C, r * bits / 8] or fp16 values [B, Hq, C, r], scale, min fp16 [B, Hq, C])


def dequantized(labels: Labels, bits: int, n_slots: int) -> torch.Tensor:
    """fp32 [B, Hq, n_slots, r]: the first n_slots labels as stored (their C >= n_slots slots of room cut off)."""
    values, scale, low = (None if t is None else t[:, :, :n_slots] for t in labels)
    if bits >= 16:
        return values.float()
    return unpack_floats(values, bits) * scale.float()[..., None] + low.float()[..., None]


def label_scores_reference(q: torch.Tensor, labels: Labels, bits: int, n_slots: int, kv_heads: int) -> torch.Tensor:
    """fp32 [B, Hkv, n_slots]: per KV head, the max over its query heads and the rows of q [B, Hq, rows, r] of
    q . label / sqrt(r)."""
    batch, hq, rows, r = q.shape
    scores = (q.float() @ dequantized(labels, bits, n_slots).transpose(-1, -2)) / r ** 0.5  # [B, Hq, rows, T]
    return scores.view(batch, kv_heads, -1, n_slots).amax(2)


def label_scores(q: torch.Tensor, labels: Labels, bits: int, n_slots: int, kv_heads: int) -> torch.Tensor:
    """label_scores_reference's scores, by sparse_cpu.c on CPU where it builds."""
    values, scale, low = labels
    batch, hq, rows, r = q.shape
    if q.is_cuda or torch.compiler.is_compiling() or sparse_native.library() is None \
            or not all(t is None or t.is_contiguous() for t in labels):
        return label_scores_reference(q, labels, bits, n_slots, kv_heads)
    out = torch.empty(batch, kv_heads, n_slots)
    qc = q.float().contiguous()
    failed = sparse_native.library().label_scores(
        values.data_ptr(), None if scale is None else scale.data_ptr(), None if low is None else low.data_ptr(), bits,
        values.shape[2], n_slots, r, qc.data_ptr(), rows, hq // kv_heads, batch * kv_heads, r ** -0.5, out.data_ptr(),
        torch.get_num_threads())
    if failed == 2:
        raise ValueError(f"label_scores: r={r} label channels; allowed values: at most {sparse_native.MAX_HEAD_DIM}")
    if failed:
        raise MemoryError("sparse_cpu.c: the label tables could not be allocated")
    return out
