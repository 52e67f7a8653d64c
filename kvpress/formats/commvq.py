"""CommVQ's codes (Li et al. 2025, arXiv 2506.18879): RoPE-commutative additive vector quantization of keys and
values: the code layout and its decoding. The codec that stores a layer's slots this way is kvpress/policies/commvq.py;
the payload and its reader kvpress/cache/vq.py.

A vector of one KV head (D channels, half-split RoPE) is seen as D/2 RoPE pairs (channel i with channel i + D/2), a
pair as one complex number. It is divided by its L2 norm (kept in fp16), cut into groups of `pairs` consecutive
pairs, and each group is approximated by a sum of `stages` codewords, chosen greedily stage by stage on the residual.
A stage's codeword is named by one 12-bit code (a, b), two 6-bit halves indexing the same table of 64 complex
entries per pair:

    codeword_p(a, b) = t[p, a] + i * t[p, b]          (i: the 90-degree rotation J of the pair)

Every codeword of a pair is a 2x2 block [[x, -y], [y, x]], which commutes with the pair's RoPE rotation: a key's
codes are taken before RoPE, and RoPE rotates the decoded sum exactly as it would rotate the key.

The codes are chosen by kvpress/kernels/vq_search.py (the nearest codeword, stage after stage) and the tables fitted
by kvpress/codebooks.py; this module is the layout: pairs, codewords, decoding, 12-bit packing.
"""

from __future__ import annotations

import torch

ENTRIES = 64  # table entries per pair: a code is two 6-bit indices, 12 bits


# ---------------------------------------------------------------------------- pairs
def to_pairs(x: torch.Tensor, pairs: int) -> torch.Tensor:
    """Vectors x [..., D] (half-split RoPE) as complex pairs [..., D / 2 / pairs groups, pairs]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].float(), x[..., half:].float())
    return z.unflatten(-1, (half // pairs, pairs))


def from_pairs(z: torch.Tensor) -> torch.Tensor:
    """Inverse of to_pairs: [..., groups, pairs] complex -> [..., D] fp32."""
    z = z.flatten(-2)
    return torch.cat([z.real, z.imag], -1)


# ---------------------------------------------------------------------------- codes
def codewords(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Codewords [N, P] (complex) of codes [N] over table [P, 64]."""
    return table[:, codes // ENTRIES].T + 1j * table[:, codes % ENTRIES].T


def bag_weights(tables: torch.Tensor) -> torch.Tensor:
    """The decoder's weights [G, 2 * S * 64, 2P] (fp32) of tables [G, S, P, 64]: row s * 64 + e is entry e of stage s,
    row (S + s) * 64 + e the same times i; columns the P real parts, then the P imaginary parts."""
    groups, stages, pairs, _ = tables.shape
    rows = tables.transpose(-1, -2).reshape(groups, stages * ENTRIES, pairs)
    rows = torch.cat([rows, rows * 1j], 1)
    return torch.cat([rows.real, rows.imag], -1).float().contiguous()


def decode(codes: torch.Tensor, norms: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Vectors [..., D] fp32 of codes [..., G, S] and norms [...] with the decoder's `weights` (bag_weights): per
    group, one sum of 2S table rows per vector (the two halves of every stage's code)."""
    groups, rows, width = weights.shape
    stages, pairs = rows // (2 * ENTRIES), width // 2
    lead = codes.shape[:-2]
    flat = codes.reshape(-1, groups, stages).long()
    base = torch.arange(stages, device=codes.device) * ENTRIES
    parts = [torch.nn.functional.embedding_bag(
        torch.cat([base + flat[:, g] // ENTRIES, stages * ENTRIES + base + flat[:, g] % ENTRIES], 1), weights[g],
        mode="sum") for g in range(groups)]  # [N, 2P] each: real parts, imaginary parts
    x = torch.cat([p[:, :pairs] for p in parts] + [p[:, pairs:] for p in parts], 1)
    return (x * norms.reshape(-1, 1).float()).reshape(*lead, -1)


# ---------------------------------------------------------------------------- 12-bit packing
def pack12(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] in [0, 4096) -> uint8 [..., 3 ceil(n/2) / 2]: two codes in three bytes (an odd n is padded with
    one code 0, whose 12 bits are held like the others)."""
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], -1)
    c = codes.long().unflatten(-1, (-1, 2))
    lo, hi = c[..., 0], c[..., 1]
    out = torch.stack([lo & 0xFF, (lo >> 8) | ((hi & 0xF) << 4), hi >> 4], -1)
    return out.flatten(-2).to(torch.uint8)


def unpack12(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack12: the n int64 codes [..., n] of packed uint8 [..., 3 ceil(n/2) / 2]."""
    b = packed.long().unflatten(-1, (-1, 3))
    lo = b[..., 0] | ((b[..., 1] & 0xF) << 8)
    hi = (b[..., 1] >> 4) | (b[..., 2] << 4)
    return torch.stack([lo, hi], -1).flatten(-2)[..., :n]
