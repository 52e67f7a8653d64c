"""CommVQ's codes (Li et al. 2025, arXiv 2506.18879): RoPE-commutative additive vector quantization of keys and
values, the code layout and its fitting. The codec that stores a layer's slots this way is kvpress/policies/commvq.py;
the payload and its reader kvpress/cache/vq.py.

A vector of one KV head (D channels, half-split RoPE) is seen as D/2 RoPE pairs (channel i with channel i + D/2), a
pair as one complex number. It is divided by its L2 norm (kept in fp16), cut into groups of `pairs` consecutive
pairs, and each group is approximated by a sum of `stages` codewords, chosen greedily stage by stage on the residual.
A stage's codeword is named by one 12-bit code (a, b), two 6-bit halves indexing the same table of 64 complex
entries per pair:

    codeword_p(a, b) = t[p, a] + i * t[p, b]          (i: the 90-degree rotation J of the pair)

Every codeword of a pair is a 2x2 block [[x, -y], [y, x]], which commutes with the pair's RoPE rotation: a key's
codes are taken before RoPE, and RoPE rotates the decoded sum exactly as it would rotate the key.

The nearest codeword of a residual r needs no 4096-way search of vectors: |r - t_a - i t_b|^2 splits into a term of
a, a term of b and a 64 x 64 table of (a, b) that depends on the codebook alone.

Fitting (`fit_tables`) is hard-assignment EM, stage after stage: assign each residual its nearest codeword, then the
tables in closed form. With the codes fixed the codewords are linear in the table entries, t_a + i t_b, so each
pair's 64 entries solve one 64 x 64 complex least-squares system, shared by every pair of a group (the codes are).
"""

from __future__ import annotations

import torch

ENTRIES = 64  # table entries per pair: a code is two 6-bit indices, 12 bits
CODE_BITS = 12
_ROWS = 512  # residual rows per block of the nearest-codeword search (a [512, 64, 64] fp32 sum: 8 MiB)


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
def nearest(residual: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The code a * 64 + b [N] of the codeword t_a + i t_b nearest each residual [N, P] (complex), table [P, 64].
    |r - t_a - i t_b|^2 - |r|^2 = A[a] + B[b] + C[a, b]: for each a the best b is a (min, +) over 64 entries, then
    the best a, then its b again (an exact argmin over the 4096 codewords, without a [N, 4096] sum)."""
    jt = table * 1j
    norms = table.abs().square().sum(0)  # [64]
    pair_terms = norms[:, None] + norms[None, :] + 2 * (table.conj()[:, :, None] * jt[:, None, :]).real.sum(0)
    codes = []
    for start in range(0, residual.shape[0], _ROWS):
        r = residual[start:start + _ROWS]
        a_term = -2 * (r.conj() @ table).real  # [n, 64]: -2 Re <r, t_a>
        b_term = -2 * (r.conj() @ jt).real
        best_b = (b_term[:, None, :] + pair_terms).amin(-1)  # [n, 64]: min over b for each a
        a = (a_term + best_b).argmin(1)
        b = (b_term + pair_terms[a]).argmin(1)
        codes.append(a * ENTRIES + b)
    return torch.cat(codes) if codes else torch.zeros(0, dtype=torch.long, device=residual.device)


def codewords(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Codewords [N, P] (complex) of codes [N] over table [P, 64]."""
    return table[:, codes // ENTRIES].T + 1j * table[:, codes % ENTRIES].T


def encode(x: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, G, S] int64, norms [N] fp32) of vectors x [N, D] over tables [G, S, P, 64] (complex): each group
    of P pairs of x / |x| is the sum of S codewords, one per stage, chosen greedily."""
    groups, stages, pairs, _ = tables.shape
    norms = x.float().norm(dim=-1)
    residual = to_pairs(x / norms.clamp(min=1e-12)[:, None], pairs)  # [N, G, P]
    codes = residual.new_zeros(x.shape[0], groups, stages, dtype=torch.long).real.long()
    for g in range(groups):
        r = residual[:, g]
        for s in range(stages):
            codes[:, g, s] = nearest(r, tables[g, s])
            r = r - codewords(codes[:, g, s], tables[g, s])
    return codes, norms


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


# ---------------------------------------------------------------------------- fitting
def _solve_table(residual: torch.Tensor, codes: torch.Tensor, ridge: float) -> torch.Tensor:
    """The table [P, 64] (complex) minimising sum_n |r_n - t_a(n) - i t_b(n)|^2 for fixed codes: normal equations
    G t = h with G = diag(#a + #b) + i (C - C^T), C[e, f] = #{n: a = e, b = f}, h_e = sum_{a=e} r - i sum_{b=e} r."""
    a, b = codes // ENTRIES, codes % ENTRIES
    count = torch.zeros(ENTRIES, ENTRIES, dtype=torch.float64, device=residual.device)
    count.index_put_((a, b), torch.ones_like(a, dtype=torch.float64), accumulate=True)
    gram = torch.diag(count.sum(1) + count.sum(0) + ridge).to(torch.complex128) + 1j * (count - count.T)
    rhs = torch.zeros(ENTRIES, residual.shape[1], dtype=torch.complex128, device=residual.device)
    r = residual.to(torch.complex128)
    rhs.index_add_(0, a, r)
    rhs.index_add_(0, b, -1j * r)
    return torch.linalg.solve(gram, rhs).T.to(residual.dtype)


def fit_tables(x: torch.Tensor, pairs: int, stages: int, iters: int = 8, ridge: float = 1e-3,
               seed: int = 0) -> tuple[torch.Tensor, list]:
    """Tables [G, S, P, 64] (complex64) fitted to vectors x [N, D] (pre-RoPE keys or values of one KV head), and the
    mean squared error of the normalised vectors after each stage (for the calibration's metrics)."""
    gen = torch.Generator().manual_seed(seed)
    norms = x.float().norm(dim=-1, keepdim=True).clamp(min=1e-12)
    residual = to_pairs(x.float() / norms, pairs)  # [N, G, P]
    groups = residual.shape[1]
    tables = torch.zeros(groups, stages, pairs, ENTRIES, dtype=torch.complex64)
    errors = []
    for s in range(stages):
        for g in range(groups):
            r = residual[:, g]
            start = r[torch.randperm(r.shape[0], generator=gen)[:ENTRIES]].T  # entries drawn from the residuals
            table = torch.zeros(pairs, ENTRIES, dtype=r.dtype)
            table[:, :start.shape[1]] = start / 2
            for _ in range(iters):
                table = _solve_table(r, nearest(r, table), ridge)
            tables[g, s] = table
            residual[:, g] = r - codewords(nearest(r, table), table)
        errors.append(float(from_pairs(residual).square().sum(-1).mean()))
    return tables, errors
