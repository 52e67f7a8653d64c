"""Online-softmax pieces shared by the block-wise attention kernels (torch side)."""

from __future__ import annotations

import torch


def empty_state(query_grouped: torch.Tensor):
    """(running max, running sum, accumulator) for query rows [B, Hkv, g, r, D]."""
    m = torch.full(query_grouped.shape[:-1], float("-inf"), device=query_grouped.device)
    return m, torch.zeros_like(m), torch.zeros_like(query_grouped, dtype=torch.float32)


def block_update(state, q, keys, values, scaling, softcap, allowed):
    """One block. q [B,Hkv,g,r,D] fp32; keys/values [B,Hkv,n,D] fp32; allowed [B,Hkv,r,n]."""
    m, l, acc = state
    logits = torch.einsum("bhgrd,bhnd->bhgrn", q, keys) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    m_new = torch.maximum(m, logits.amax(-1))
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    p = torch.exp(logits - safe[..., None])
    correction = torch.exp(m - safe)
    l = l * correction + p.sum(-1)
    acc = acc * correction[..., None] + torch.einsum("bhgrn,bhnd->bhgrd", p, values)
    return m_new, l, acc


def merge_splits(m_part, l_part, acc_part, shape, dim):
    """Merge per-split partials [BH, S, M(, D)] of a split-K kernel into one state shaped `shape` (+ D)."""
    rows = shape[-1] * shape[-2]
    m = m_part.amax(1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(m_part - safe[:, None])
    l = (l_part * w).sum(1)
    acc = (acc_part * w[..., None]).sum(1)
    return m[:, :rows].reshape(shape), l[:, :rows].reshape(shape), acc[:, :rows].reshape(*shape, dim)


def finish(state, query):
    _, l, acc = state
    batch, hq, rows, dim = query.shape
    return (acc / l[..., None]).reshape(batch, hq, rows, dim).to(query.dtype)
