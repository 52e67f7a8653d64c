"""The CPU kernel of lowbit_cpu.c (attention over slot-ordered KIVI or GEAR codes), built by native.py on the first
low-bit read (about 15 s with GCC 12) and run on torch's OpenMP thread pool.

`available()` is False where no compiler works (a warning says why, once); `lowbit_attention_state` in
quant_attention.py then reads through `codes_domain_attention_state`, the torch version of the same computation
(same results, slower)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..formats.lowbit import LowBitCodes
from .native import NativeLibrary
from .online_softmax import Queries, State, merge_states
from .sparse_attention import run_grid

SOURCE = Path(__file__).with_name("lowbit_cpu.c")
MAX_HEAD_DIM = 1024  # the kernel unpacks one row into a stack buffer of this many floats
MIN_SPLIT = 256  # slots per work item, at least: fewer make the merge cost more than the parallelism gives


class _GearTerms(ctypes.Structure):
    """lowbit_cpu.c's gear_terms."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("k_lr", "v_lr", "k_basis", "v_basis", "chunk",
                                                     "k_out_slot", "k_out_chan", "k_out_val", "v_out_idx",
                                                     "v_out_val")] + \
        [(name, ctypes.c_int64) for name in ("rank", "n_chunks", "n_k", "n_v")]


def _declare(library) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.lowbit_attention.argtypes = ([ptr] * 4 + [i64] + [ptr] * 5 + [ctypes.c_float] + [ptr] * 3 + [i64] * 6
                                         + [ctypes.c_int, i64, ctypes.c_int] + [ptr] * 2 + [i64] + [ptr] * 3
                                         + [i64, i64, ptr])
    library.lowbit_attention.restype = ctypes.c_int


_native = NativeLibrary(SOURCE, _declare, "the CPU low-bit kernel",
                        "low-bit attention reads through torch instead (same results, slower)")


def available() -> bool:
    return _native.get() is not None


def supports(queries: Queries, codes: LowBitCodes) -> bool:
    """KIVI or GEAR codes (slot-ordered, gathered after an eviction, or flat runs) with fp16 scales, no softcap,
    on CPU, outside torch.compile (a compiled graph traces the torch version instead of breaking at a foreign
    call)."""
    return (not torch.compiler.is_compiling() and not queries.values.is_cuda
            and codes.k_scale.dtype == codes.v_scale.dtype == torch.float16
            and (codes.k_lr is None or codes.k_lr.dtype == codes.k_basis.dtype == torch.float16)
            and queries.softcap is None and codes.head_dim <= MAX_HEAD_DIM and available())


def lowbit_attention_state_native(queries: Queries, codes: LowBitCodes, positions, valid=None,
                                  state: State | None = None, tail: tuple | None = None) -> State:
    """`codes_domain_attention_state`'s result (see there for the algebra) over rectangular codes [B, Hkv, T],
    computed by lowbit_cpu.c; with `tail` = (keys, values, positions, valid) of the full-precision rectangle after
    the codes, that too, in the same call."""
    hkv = codes.k_codes.shape[1]
    group = queries.values.shape[1] // hkv
    allowed = queries.kernel_mask(positions, valid, group)
    part = _run(queries, codes, codes.k_codes.shape[0], hkv, allowed, codes.num_slots,
                tail=_tail_arrays(queries, tail, group))
    return part if state is None else merge_states(state, part)


def flat_lowbit_attention_state_native(queries: Queries, codes: LowBitCodes, positions, lengths,
                                       state: State | None = None, tail: tuple | None = None) -> State:
    """`flat_lowbit_attention_state`'s result (codes/positions [1, 1, N]: one store, each (row, head) a run of
    `lengths` [B, Hkv] slots in (row, head) order), computed by lowbit_cpu.c: each run is read in place by its
    own (row, head)'s queries; with `tail` (a full-precision rectangle, as in lowbit_attention_state_native),
    that too, in the same call."""
    batch, hkv = lengths.shape
    group = queries.values.shape[1] // hkv
    flat_lengths = lengths.flatten().long()
    starts = flat_lengths.cumsum(0) - flat_lengths
    width = int(flat_lengths.max()) if flat_lengths.numel() else 0
    allowed = None
    if not queries.reads_every_slot(None):  # runs hold real tokens only: the mask is causality (and a window)
        indices, ok = run_grid(starts.view(batch, hkv), lengths, width, codes.num_slots)
        allowed = queries.kernel_mask(positions[0, 0][indices], ok, group)
    part = _run(queries, codes, batch, hkv, allowed, width, runs=(starts, flat_lengths),
                tail=_tail_arrays(queries, tail, group))
    return part if state is None else merge_states(state, part)


def _tail_arrays(queries: Queries, tail: tuple | None, group: int) -> tuple | None:
    """(keys, values fp32 [B, Hkv, n, D], allowed, slots per head in keys'/values' storage) of a full-precision
    rectangle read in the kernel's call. The filled prefix of a buffer with spare room (a layer's tail) is read
    in place, not copied."""
    if tail is None:
        return None
    keys, values = _rows_in_place(tail[0].float()), _rows_in_place(tail[1].float())
    if keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    return keys, values, queries.kernel_mask(tail[2], tail[3], group), keys.stride(1) // max(keys.shape[-1], 1)


def _rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, n, D] itself when its storage is [B, H, S >= n, D] in that order (a prefix of slots), else a
    contiguous copy."""
    batch, heads, n, dim = t.shape
    slots = t.stride(1) // dim if dim else n
    if t.stride(3) == 1 and t.stride(2) == dim and t.stride(1) == slots * dim and slots >= n \
            and (batch == 1 or t.stride(0) == heads * slots * dim):
        return t
    return t.contiguous()


def _run(queries: Queries, codes: LowBitCodes, batch: int, hkv: int, allowed, allowed_width: int,
         runs: tuple | None = None, tail: tuple | None = None) -> State:
    """One call of lowbit_cpu.c's lowbit_attention: the state [B, Hkv, g, r(, D)] of `queries` over `codes`
    (rectangular, or flat with runs = (starts, lengths) [B * Hkv] int64)."""
    q = queries.grouped(hkv)
    _, _, group, rows, dim = q.shape
    n_rows, heads = group * rows, batch * hkv
    qr = q.reshape(batch, hkv, n_rows, dim).contiguous()
    scales = [t.contiguous() for t in (codes.k_scale, codes.k_min, codes.v_scale, codes.v_min)]  # fp16
    k_codes, v_codes = codes.k_codes.contiguous(), codes.v_codes.contiguous()
    k_group = None if codes.k_group is None else codes.k_group.to(torch.int32).contiguous()
    tail_keys, tail_values, tail_allowed, tail_stride = tail or (None, None, None, 0)
    n_tail = 0 if tail_keys is None else tail_keys.shape[2]
    gear, keep = _gear_terms(codes)
    threads = torch.get_num_threads()
    per_head = codes.num_slots if runs is None else codes.num_slots // max(heads, 1)
    splits = max(1, min(-(-2 * threads // heads), per_head // MIN_SPLIT))
    m = torch.empty(heads, n_rows)
    l, acc = torch.empty_like(m), torch.empty(heads, n_rows, dim)
    starts, lengths = runs or (None, None)
    failed = _native.get().lowbit_attention(
        k_codes.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr(), _pointer(k_group), codes.k_scale.shape[2],
        v_codes.data_ptr(), scales[2].data_ptr(), scales[3].data_ptr(), qr.data_ptr(), _pointer(allowed),
        float(queries.scaling), m.data_ptr(), l.data_ptr(), acc.data_ptr(), heads, codes.num_slots, dim, n_rows,
        codes.group_size, codes.v_scale.shape[-1], codes.bits, splits, threads, _pointer(starts), _pointer(lengths),
        allowed_width, _pointer(tail_keys), _pointer(tail_values), _pointer(tail_allowed), n_tail, tail_stride,
        None if gear is None else ctypes.byref(gear))
    del keep  # the tensors behind gear's pointers lived through the call
    if failed:
        raise MemoryError("lowbit_cpu.c: a work buffer could not be allocated")
    shape = (batch, hkv, group, rows)
    return m.view(shape), l.view(shape), acc.view(*shape, dim)


def _gear_terms(codes: LowBitCodes):
    """(gear_terms, the tensors its pointers point into) for GEAR codes; (None, ()) for KIVI's. Flat codes hold
    every run's chunks and key outliers in one list each, in no per-run order (flushes append theirs): the kernel
    reads each chunk a run's slots point at, and each run looks through every outlier."""
    if codes.k_lr is None:
        return None, ()
    tensors = dict(k_lr=codes.k_lr, v_lr=codes.v_lr, k_basis=codes.k_basis, v_basis=codes.v_basis,
                   chunk=codes.chunk.to(torch.int32), k_out_slot=codes.k_out_slot.to(torch.int32),
                   k_out_chan=codes.k_out_chan.to(torch.int32), k_out_val=codes.k_out_val,
                   v_out_idx=codes.v_out_idx.to(torch.int32), v_out_val=codes.v_out_val)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    gear = _GearTerms(**{name: t.data_ptr() for name, t in tensors.items()}, rank=codes.k_basis.shape[-1],
                      n_chunks=codes.k_basis.shape[2], n_k=codes.k_out_slot.shape[-1], n_v=codes.v_out_idx.shape[-1])
    return gear, tensors


def _pointer(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()
