"""LESS's feature maps (Dong et al. 2024, arXiv 2402.09398): the learned kernel that lets evicted tokens live on in a
constant-size state. Per head, with sigma = GELU (as the official `LlamaAttentionLESS`):
  query   phi(q) = | sigma(sigma(q W1q) W2q) |                                   [.., R], one map per query head
  key     u = |s1| * sigma(sigma(k W1k) W2k),  psi(k) = | u + (u Wint) * s2 |     [.., R], one map per KV head
so that phi(q) . psi(k) stands for exp(q . k * scaling) of a token the cache no longer holds. The state of a KV head
is H = sum psi(k_j) v_j^T [R, D] and z = sum psi(k_j) [R] over its evicted tokens j; a read adds phi(q) H to the
softmax numerator and phi(q) . z to its denominator.

`maps` is a dict of per-layer tensors, the file's (formats/calibration.py, `less_*`):
  q1 [Hq, D, M], q2 [Hq, M, R], k1 [Hkv, D, M], k2 [Hkv, M, R], interaction [Hkv, R, R], scale1, scale2 [Hkv, R]
"""

from __future__ import annotations

import torch
from torch.nn.functional import gelu

NAMES = ("q1", "q2", "k1", "k2", "interaction", "scale1", "scale2")


def query_features(q: torch.Tensor, maps: dict) -> torch.Tensor:
    """phi of queries [B, Hq, r, D] -> [B, Hq, r, R] (fp32)."""
    hidden = gelu(torch.einsum("bhsd,hdm->bhsm", q.float(), maps["q1"].float()))
    return gelu(torch.einsum("bhsm,hmr->bhsr", hidden, maps["q2"].float())).abs()


def key_features(k: torch.Tensor, maps: dict) -> torch.Tensor:
    """psi of keys [B, Hkv, n, D] -> [B, Hkv, n, R] (fp32)."""
    hidden = gelu(torch.einsum("bhsd,hdm->bhsm", k.float(), maps["k1"].float()))
    u = maps["scale1"].float().abs()[None, :, None] * gelu(torch.einsum("bhsm,hmr->bhsr", hidden, maps["k2"].float()))
    return (u + torch.einsum("bhsr,hrt->bhst", u, maps["interaction"].float()) * maps["scale2"].float()[None, :, None]
            ).abs()


def summary_state(q: torch.Tensor, maps: dict, big_h: torch.Tensor, z: torch.Tensor):
    """The online-softmax state (m, l, acc) of the evicted tokens for query rows q [B, Hq, r, D]: m = 0,
    l = phi(q) . z [B, Hkv, g, r], acc = phi(q) H [B, Hkv, g, r, D], with H [B, Hkv, R, D], z [B, Hkv, R]."""
    batch, hq, rows, _ = q.shape
    heads = z.shape[1]
    phi = query_features(q, maps).view(batch, heads, hq // heads, rows, -1)
    l = torch.einsum("bhgrk,bhk->bhgr", phi, z)
    acc = torch.einsum("bhgrk,bhkd->bhgrd", phi, big_h)
    return torch.zeros_like(l), l, acc
