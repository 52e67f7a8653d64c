"""The CPU kernels of sparse_cpu.c (attention over a selection of stored slots, read in place; Double Sparsity's
label scores: kernels/labels.py; top-k selections: kernels/slots.py), built by native.py
on the first sparse read on CPU and run on torch's OpenMP thread pool. Where no compiler works (a warning says so,
once), `sparse_attention_state` reads through `sparse_attention_state_reference`, the torch version of the same
computation (same results, slower: it gathers the selected rows into a copy first)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary
from .online_softmax import Queries, State

SOURCE = Path(__file__).with_name("sparse_cpu.c")
MAX_HEAD_DIM = 1024  # the kernel converts one row into a stack buffer of this many floats
MIN_SPLIT = 256  # selected slots per work item, at least: fewer make the merge cost more than the parallelism gives
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(library) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.sparse_attention.argtypes = ([ptr, ptr, ctypes.c_int] + [ptr] * 6 + [i64, ptr, ptr] + [i64] * 5
                                         + [ctypes.c_float] * 2 + [i64, i64, ctypes.c_int] + [ptr] * 3)
    library.sparse_attention.restype = ctypes.c_int
    library.label_scores.argtypes = [ptr] * 3 + [ctypes.c_int] + [i64] * 3 + [ptr] + [i64] * 3 + [ctypes.c_float,
                                                                                          ptr, ctypes.c_int]
    library.label_scores.restype = ctypes.c_int
    library.top_slots.argtypes = [ptr, ptr] + [i64] * 4 + [ptr, ptr, ctypes.c_int]
    library.top_slots.restype = ctypes.c_int


_native = NativeLibrary(SOURCE, _declare, "the CPU sparse-read kernel",
                        "sparse reads gather the selected slots in torch instead (same results, slower)")


def library() -> ctypes.CDLL | None:
    """sparse_cpu.c, built on first use; None where no compiler works (a warning says so, once)."""
    return _native.get()


def supports(queries: Queries, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """On CPU, outside torch.compile (a compiled graph traces the torch version instead of breaking at a foreign
    call), one set of query positions for every batch row, keys and values of one dtype the kernel reads."""
    return (not torch.compiler.is_compiling() and not queries.values.is_cuda and queries.positions.dim() == 1
            and keys.dtype == values.dtype and keys.dtype in _DTYPES and keys.shape[-1] <= MAX_HEAD_DIM
            and keys.stride(-1) == 1 and values.stride(-1) == 1 and library() is not None)


def _strides(t: torch.Tensor, batch: int, heads: int):
    """int64[3] (b, h, slot) strides in elements of a [B, H, T(, D)] tensor, or of a flat store ([N(, D)]) that every
    (row, head) reads: 0 for b and h."""
    slot_dims = 1 if t.dim() in (1, 2) else 3
    b, h = (0, 0) if slot_dims == 1 else (t.stride(0) if batch > 1 else 0, t.stride(1) if heads > 1 else 0)
    return (ctypes.c_int64 * 3)(b, h, t.stride(slot_dims - 1))


def sparse_attention_state_native(queries: Queries, keys, values, positions, indices: torch.Tensor,
                                  valid: torch.Tensor | None) -> State:
    """`sparse_attention_state_reference`'s state (no state to extend) of `queries` over the slots `indices`
    [B, Hkv, K] (`valid`: the real entries, None: all) of keys/values [B, Hkv, T, D] or a flat store [N, D]."""
    batch, hkv, width = indices.shape
    q = queries.grouped(hkv)
    _, _, group, rows, dim = q.shape
    n_rows = group * rows
    qr = q.reshape(batch * hkv, n_rows, dim).contiguous()
    idx = indices.contiguous()
    ok = None if valid is None else valid.contiguous().view(torch.uint8)
    positions = positions.to(torch.int32)  # the cache's own dtype: no copy
    q_pos = queries.positions.to(torch.int64).contiguous()
    strides = [_strides(t, batch, hkv) for t in (keys, values, positions)]
    threads = torch.get_num_threads()
    heads = batch * hkv
    splits = max(1, min(-(-2 * threads // max(heads, 1)), width // MIN_SPLIT))
    m = torch.empty(heads, n_rows)
    l, acc = torch.empty_like(m), torch.empty(heads, n_rows, dim)
    window = queries.sliding_window or 0
    failed = library().sparse_attention(
        keys.data_ptr(), values.data_ptr(), _DTYPES[keys.dtype], strides[0], strides[1], positions.data_ptr(),
        strides[2], idx.data_ptr(), None if ok is None else ok.data_ptr(), width,
        qr.data_ptr(), q_pos.data_ptr(), rows, n_rows, dim, batch, hkv, float(queries.scaling),
        float(queries.softcap or 0.0), window, splits, threads, m.data_ptr(), l.data_ptr(), acc.data_ptr())
    if failed:
        raise MemoryError("sparse_cpu.c: a work buffer could not be allocated")
    shape = (batch, hkv, group, rows)
    return m.view(shape), l.view(shape), acc.view(*shape, dim)
