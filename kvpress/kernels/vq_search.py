"""CommVQ's encoder (formats/commvq.py is the layout): each vector, divided by its norm, as a sum of one codeword per
stage, chosen greedily on the residual. The nearest of a stage's 4096 codewords t_a + i t_b needs no search over
vectors: |r - t_a - i t_b|^2 - |r|^2 = A[a] + B[b] + C[a, b], with A and B two [64] products of r with the table
and C a [64, 64] table of the codebook alone. For each a the best b is a (min, +) over 64 entries, then the best a,
then its b again: an exact argmin over the 4096 codewords.

`nearest` runs vq_cpu.c (built by native.py) on CPU, where a compiler works: the per-a minimum is one vector
reduction, no [N, 64, 64] tensor is written. `nearest_reference` is the same computation in torch (same codes).
`encode` codes every stage of a row in one vq_cpu.c call (a flush of a few slots was dozens of small torch calls);
`encode_reference` is its torch form, stage by stage (A and B summed in another order: a near tie can go the other
way, the codeword chosen is as near either way)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats.commvq import ENTRIES, codewords, to_pairs
from .native import NativeLibrary

SOURCE = Path(__file__).with_name("vq_cpu.c")
_ROWS = 512  # residual rows per block of the torch search (a [512, 64, 64] fp32 sum: 8 MiB)
MAX_PAIRS = 64  # vq_cpu.c's residual buffers (a group of 64 pairs: 128 channels, the most a group holds)


def pair_terms(table: torch.Tensor) -> torch.Tensor:
    """C [64, 64] fp32 of table [P, 64]: |t_a|^2 + |t_b|^2 + 2 Re(conj(t_a) i t_b) summed over the pairs; the codebook
    alone decides it, so a coder that searches one table many times computes it once (`encode`'s `terms`)."""
    jt = table * 1j
    norms = table.abs().square().sum(0)
    return (norms[:, None] + norms[None, :] + 2 * (table.conj()[:, :, None] * jt[:, None, :]).real.sum(0)).float()


@dataclass(frozen=True)
class Prepared:
    """What the encoder derives from tables [G, S, P, 64] (complex) alone, so a coder that searches them many times
    (every flush of a layer) builds it once: the pair terms [G, S, 64, 64] (the torch search's C), and vq_cpu.c's
    inputs, the tables' real and imaginary parts and the terms transposed."""

    terms: torch.Tensor
    real: torch.Tensor
    imag: torch.Tensor
    terms_t: torch.Tensor


def prepare(tables: torch.Tensor) -> Prepared:
    terms = torch.stack([torch.stack([pair_terms(t) for t in per_group]) for per_group in tables])
    return Prepared(terms, tables.real.float().contiguous(), tables.imag.float().contiguous(),
                    terms.transpose(-1, -2).contiguous())


def _terms(residual: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor | None = None):
    """(A [N, 64], B [N, 64], C [64, 64]) fp32 of residuals [N, P] (complex) over table [P, 64]; C is `pairs` when
    given (pair_terms of the table)."""
    pairs = pair_terms(table) if pairs is None else pairs
    return -2 * (residual.conj() @ table).real, -2 * (residual.conj() @ (table * 1j)).real, pairs


def nearest_reference(residual: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """The code a * 64 + b [N] of the codeword t_a + i t_b nearest each residual [N, P] (complex), table [P, 64]
    (`pairs`: its pair_terms, when already computed)."""
    a_term, b_term, pair_c = _terms(residual, table, pairs)
    codes = []
    for start in range(0, residual.shape[0], _ROWS):
        a_part, b_part = a_term[start:start + _ROWS], b_term[start:start + _ROWS]
        best_b = (b_part[:, None, :] + pair_c).amin(-1)  # [n, 64]: min over b for each a
        a = (a_part + best_b).argmin(1)
        b = (b_part + pair_c[a]).argmin(1)
        codes.append(a * ENTRIES + b)
    return torch.cat(codes) if codes else torch.zeros(0, dtype=torch.long, device=residual.device)


def _declare(library) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.vq_nearest.argtypes = [ptr, ptr, ptr, i64, ptr]
    library.vq_nearest.restype = None
    library.vq_encode.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    library.vq_encode.restype = ctypes.c_int


_native = NativeLibrary(SOURCE, _declare, "the CPU codebook search",
                        "CommVQ codes are chosen in torch instead (same codes, slower)")


def available() -> bool:
    return _native.get() is not None


def nearest(residual: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """nearest_reference's codes, by vq_cpu.c on CPU where it builds."""
    if residual.is_cuda or not available():
        return nearest_reference(residual, table, pairs)
    a_term, b_term, pair_c = _terms(residual, table, pairs)
    a_term, b_term, pair_t = a_term.float().contiguous(), b_term.float().contiguous(), pair_c.T.contiguous()
    codes = torch.empty(residual.shape[0], dtype=torch.int64)
    _native.get().vq_nearest(a_term.data_ptr(), b_term.data_ptr(), pair_t.data_ptr(), residual.shape[0],
                        codes.data_ptr())
    return codes


def _unit_pairs(x: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / |x| as complex pairs [N, G, P], norms [N] fp32) of vectors x [N, D]."""
    norms = x.float().norm(dim=-1)
    return to_pairs(x / norms.clamp(min=1e-12)[:, None], pairs), norms


def encode_reference(x: torch.Tensor, tables: torch.Tensor, prepared: Prepared | None = None):
    """(codes [N, G, S] int64, norms [N] fp32) of vectors x [N, D] over tables [G, S, P, 64] (complex): each group
    of P pairs of x / |x| is the sum of S codewords, one per stage, chosen greedily. `prepared`: prepare(tables),
    when the caller keeps it."""
    groups, stages, pairs, _ = tables.shape
    residual, norms = _unit_pairs(x, pairs)
    codes = torch.zeros(x.shape[0], groups, stages, dtype=torch.long, device=x.device)
    for g in range(groups):
        r = residual[:, g]
        for s in range(stages):
            codes[:, g, s] = nearest(r, tables[g, s], None if prepared is None else prepared.terms[g, s])
            r = r - codewords(codes[:, g, s], tables[g, s])
    return codes, norms


def encode(x: torch.Tensor, tables: torch.Tensor, prepared: Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_reference's codes and norms, every stage of a row in one vq_cpu.c call on CPU where it builds."""
    groups, stages, pairs, _ = tables.shape
    if x.is_cuda or not available() or pairs > MAX_PAIRS:
        return encode_reference(x, tables, prepared)
    residual, norms = _unit_pairs(x, pairs)
    prepared = prepare(tables) if prepared is None else prepared
    re, im = residual.real.contiguous(), residual.imag.contiguous()
    codes = torch.empty(x.shape[0], groups, stages, dtype=torch.int64)
    _native.get().vq_encode(re.data_ptr(), im.data_ptr(), prepared.real.data_ptr(), prepared.imag.data_ptr(),
                            prepared.terms_t.data_ptr(), x.shape[0], groups, stages, pairs, codes.data_ptr())
    return codes, norms
