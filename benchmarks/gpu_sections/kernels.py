"""Section 2: Triton kernels and torch fast paths against their torch references over random shapes."""

from __future__ import annotations

import math
import random
import time

import torch

from kvpress.cache.codecs import encode_kivi
from kvpress.kernels.online_softmax import Queries
from kvpress.kernels.quant_attention import (codes_domain_attention_state, flat_lowbit_attention_state,
                                             lowbit_attention_state_reference)
from kvpress.kernels.sparse_attention import Selection, sparse_attention_state_reference
from kvpress.kernels.triton_quant import available as triton_available, lowbit_attention_state_triton
from kvpress.kernels.triton_sparse import sparse_attention_state_triton

from .common import KIVI_GROUP, TOLERANCE, TimeLimit, attempt


def _ragged_subset(batch, heads, n_old, keep, device):
    """Random distinct slots of [0, n_old) per (row, head), ragged counts: (order [B, H, K], ok [B, H, K])."""
    counts = (torch.rand(batch, heads, device=device) * keep * n_old).round().long().clamp(0, n_old)
    width = int(counts.max()) if n_old else 0
    order = torch.rand(batch, heads, n_old, device=device).argsort(-1)[..., :width]
    ok = torch.arange(width, device=device) < counts[..., None]
    return order, ok


def _output(state):
    return state[2] / state[1][..., None]  # normalised fp32 output [B, Hkv, g, r, D]


def _compare(got, ref, tol) -> dict:
    a, b = _output(got), _output(ref)
    finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
    scale = float(b.abs().max()) if finite else 1.0
    err = (a - b).abs()
    bad = int((err > tol * max(scale, 1e-12)).sum()) if finite else a.numel()
    return dict(max_rel_err=float(err.max()) / max(scale, 1e-12) if finite else float("nan"), mismatches=bad,
                elements=a.numel(), ok=bad == 0)


def sample_shape(rng: random.Random, lim: dict) -> dict:
    dim = rng.choice(lim["dims"])
    hkv = rng.choice(lim["kv_heads"])
    group = rng.randint(1, lim["max_group"])
    rows = rng.choice(lim["rows"])
    length = max(rows + 1, int(round(math.exp(rng.uniform(0, math.log(lim["max_len"]))))))
    batch = min(lim["max_batch"], rng.choice([1, 1, 2, 3, 4, 8, 16]))
    while batch * hkv * length > lim["max_slots"]:
        if batch > 1:
            batch = max(1, batch // 2)
        elif hkv > 1:
            hkv //= 2
        else:
            length = lim["max_slots"]
    return dict(batch=batch, kv_heads=hkv, group=group, rows=rows, length=length, head_dim=dim,
                dtype=rng.choice(lim["dtypes"]), bits=rng.choice([2, 4]), keep=round(rng.uniform(0.02, 1.0), 3),
                drop=round(rng.uniform(0.0, 0.5), 3), gathered=rng.random() < 0.3)


def kernel_cases(shape: dict, device, lim: dict):
    """Yields (kernel name, kernel() -> state, reference() -> state) for one random shape; the caller runs both
    before asking for the next (later cases rebind the names the functions read)."""
    B, H, g, R, T, Dh = (shape[k] for k in ("batch", "kv_heads", "group", "rows", "length", "head_dim"))
    dtype = getattr(torch, shape["dtype"])
    tri = dict(block_t=lim["block_t"], target_programs=lim["target_programs"]) if lim["block_t"] else {}
    q = torch.randn(B, H * g, R, Dh, device=device, dtype=dtype)
    scaling = Dh ** -0.5

    def keys_like(*lead):  # keys with per-channel offsets, as real keys have
        return (torch.randn(*lead, Dh, device=device) + 2 * torch.randn(Dh, device=device)).to(dtype)

    # sparse gather over a rectangular cache: ragged random subsets + the rows' own slots
    queries = Queries(q, torch.arange(T - R, T, device=device), scaling)
    k, v = keys_like(B, H, T), torch.randn(B, H, T, Dh, device=device, dtype=dtype)
    positions = torch.arange(T, device=device).expand(B, H, T)
    order, ok_old = _ragged_subset(B, H, T - R, shape["keep"], device)
    own = torch.arange(T - R, T, device=device).expand(B, H, R)
    sel = Selection(torch.cat([order, own], -1), torch.cat([ok_old, torch.ones_like(own, dtype=torch.bool)], -1))
    yield ("sparse (triton)", lambda: sparse_attention_state_triton(queries, k, v, positions, sel, **tri),
           lambda: sparse_attention_state_reference(queries, k, v, positions, sel))
    del k, v

    # ragged flat per-head runs: one store [N, D], each (row, head) a run of its kept tokens in position order
    sorted_old = torch.where(ok_old, order, T).sort(-1).values
    run_pos = torch.cat([sorted_old, own], -1)
    run_ok = torch.cat([torch.sort(ok_old.long(), -1, descending=True).values.bool(),
                        torch.ones_like(own, dtype=torch.bool)], -1)
    flat_pos = run_pos[run_ok]
    lengths = run_ok.sum(-1)
    starts = (lengths.flatten().cumsum(0) - lengths.flatten()).view(B, H)
    width = int(lengths.max())
    rank = torch.arange(width, device=device)
    grid_ok = rank < lengths[..., None]
    grid = torch.where(grid_ok, starts[..., None] + rank, 0)
    n = flat_pos.numel()
    kf, vf = keys_like(n), torch.randn(n, Dh, device=device, dtype=dtype)
    flat_sel = Selection(grid, grid_ok)
    yield ("flat runs (triton)", lambda: sparse_attention_state_triton(queries, kf, vf, flat_pos, flat_sel, **tri),
           lambda: sparse_attention_state_reference(queries, kf, vf, flat_pos, flat_sel))
    del kf, vf

    # KIVI codes: rectangular (slot-ordered or gathered after an eviction), ragged validity per head
    Tq = max(KIVI_GROUP, (T // KIVI_GROUP) * KIVI_GROUP)
    Rq = min(R, Tq - 1)
    queries = Queries(q[:, :, :Rq], torch.arange(Tq - Rq, Tq, device=device), scaling)
    valid = torch.rand(B, H, Tq, device=device) >= torch.rand(B, H, 1, device=device) * shape["drop"]
    valid[..., -Rq:] = True
    seg = encode_kivi(keys_like(B, H, Tq), torch.randn(B, H, Tq, Dh, device=device, dtype=dtype), valid,
                      shape["bits"], KIVI_GROUP)
    positions = torch.arange(Tq, device=device).expand(B, H, Tq)
    if shape["gathered"]:
        n_keep = max(1, int(shape["keep"] * (Tq - Rq)))
        old = torch.rand(B, H, Tq - Rq, device=device).argsort(-1)[..., :n_keep].sort(-1).values
        keep = torch.cat([old, torch.arange(Tq - Rq, Tq, device=device).expand(B, H, Rq)], -1)
        seg, positions, valid = seg.gather(keep), positions.gather(-1, keep), valid.gather(-1, keep)
    memo = {}

    def ref():  # one reference for the three low-bit paths
        if "state" not in memo:
            memo["state"] = lowbit_attention_state_reference(queries, seg, positions, valid)
        return memo["state"]

    bits = shape["bits"]
    yield f"kivi-{bits} (triton)", lambda: lowbit_attention_state_triton(queries, seg, positions, valid, **tri), ref
    if not shape["gathered"]:
        if B * H * Tq <= lim["codes_domain_max"]:
            yield (f"kivi-{bits} codes domain (torch)",
                   lambda: codes_domain_attention_state(queries, seg, positions, valid), ref)
        if B * H * Tq <= lim["flat_lowbit_max"]:
            yield (f"kivi-{bits} flat runs (torch)",
                   lambda: flat_lowbit_attention_state(queries, seg.flatten(valid), positions[valid][None, None],
                                                       valid.sum(-1)), ref)


def section_kernels(args, device, report, sec, deadline):
    cpu = device.type == "cpu"
    if cpu:
        lim = dict(n=args.shapes or 12, dims=[64, 128], kv_heads=[1, 2, 4], max_group=8, rows=[1, 1, 3], max_len=160,
                   max_batch=3, max_slots=1024, dtypes=["float32"], block_t=16, target_programs=4,
                   codes_domain_max=10 ** 9, flat_lowbit_max=10 ** 9)
    else:
        lim = dict(n=args.shapes or (50 if args.quick else 500), dims=[64, 128], kv_heads=[1, 2, 4, 8],
                   max_group=8, rows=[1, 1, 1, 5], max_len=16384 if args.quick else 131072, max_batch=16,
                   max_slots=8 * 2 ** 20, dtypes=["bfloat16", "float16"], block_t=None, target_programs=None,
                   codes_domain_max=2 * 2 ** 20, flat_lowbit_max=2 ** 20)
    sec["notes"] += [
        f"{lim['n']} random shapes (seed {args.seed}): head dim {lim['dims']}, KV heads {lim['kv_heads']}, GQA group "
        f"1-{lim['max_group']}, query rows {sorted(set(lim['rows']))}, length log-uniform 1-{lim['max_len']:,}, "
        f"batch 1-{lim['max_batch']} (batch x KV heads x length <= {lim['max_slots']:,}), dtypes {lim['dtypes']}. "
        f"KIVI group {KIVI_GROUP}: codes hold max(32, length rounded down to 32) slots.",
        "Each shape runs every kernel: Triton sparse gather (rectangular cache), Triton over a flat store of ragged "
        "per-head runs, Triton KIVI 2/4-bit (slot-ordered, or gathered after an eviction in 30% of shapes), and "
        "the torch fast paths codes-domain and flat low-bit runs (slot-ordered codes only, size-capped). Ragged: "
        "random per-head counts / validity; the query rows' own slots are always present (causal masking).",
        "Mismatch: an element with |kernel - reference| > tol * max|reference| of its case (fp32 outputs before "
        "the final cast), tol = 2e-2 bf16, 4e-3 fp16, 1e-4 fp32. References: sparse_attention_state_reference, "
        "lowbit_attention_state_reference (fp32 math over the same inputs/codes).",
    ]
    if cpu:
        sec["notes"].append("CPU dry run: Triton in interpreter mode (TRITON_INTERPRET=1), fp32, tiny shapes, "
                            "block_t 16 and 4 target programs (several splits per head).")
    if not triton_available():
        raise RuntimeError("Triton is not available (not installed, or CPU without TRITON_INTERPRET=1)")
    rows = report.table(sec, "per kernel", [("kernel", "kernel"), ("cases", "cases"), ("failed", "failed cases"),
                                             ("mismatches", "mismatched elements"), ("elements", "elements"),
                                             ("max_rel_err", "max err / max|ref|"), ("worst", "worst case")])
    cases = []
    sec["cases"] = cases
    rng = random.Random(args.seed)
    summary = {}
    for i in range(lim["n"]):
        if deadline.expired():
            sec["notes"].append(f"time limit: {i} of {lim['n']} shapes run")
            raise TimeLimit
        shape = sample_shape(rng, lim)
        torch.manual_seed(args.seed * 100003 + i)
        tol = TOLERANCE[getattr(torch, shape["dtype"])]
        start = time.perf_counter()

        def run_shape():
            out = []
            for name, kernel, reference in kernel_cases(shape, device, lim):
                res, why = attempt(lambda: _compare(kernel(), reference(), tol))
                out.append((name, res or dict(ok=False, mismatches=0, elements=0, max_rel_err=float("nan"),
                                              error=why)))
            return out

        with torch.no_grad():
            results, why = attempt(run_shape)
        for name, res in results or [("(shape)", dict(ok=False, mismatches=0, elements=0,
                                                        max_rel_err=float("nan"), error=why))]:
            cases.append(dict(shape=i, kernel=name, tol=tol, **shape, **res))
            s = summary.setdefault(name, dict(kernel=name, cases=0, failed=0, mismatches=0, elements=0,
                                               max_rel_err=0.0, worst=""))
            s["cases"] += 1
            s["failed"] += 0 if res["ok"] else 1
            s["mismatches"] += res["mismatches"]
            s["elements"] += res["elements"]
            err, prev = res["max_rel_err"], s["max_rel_err"]
            if not s["worst"] or (not math.isnan(prev) and (math.isnan(err) or err > prev)):  # nan: worst
                s["max_rel_err"] = err
                s["worst"] = (f"#{i} B{shape['batch']} Hkv{shape['kv_heads']} g{shape['group']} r{shape['rows']} "
                              f"T{shape['length']} D{shape['head_dim']} {shape['dtype']}")
        if why:
            sec["notes"].append(f"shape #{i} {shape}: {why}")
        print(f"[kernels] shape {i + 1}/{lim['n']} T={shape['length']} B={shape['batch']} {shape['dtype']}: "
              f"{'ok' if results and all(r['ok'] for _, r in results) else 'MISMATCH/ERROR'} "
              f"({time.perf_counter() - start:.2f} s, first calls include Triton compiles)", flush=True)
        rows[:] = sorted(summary.values(), key=lambda r: r["kernel"])
        if i % 25 == 0:
            report.write()
    failed = sum(r["failed"] for r in rows)
    sec["notes"].append(f"{lim['n']} shapes, {sum(r['cases'] for r in rows)} kernel cases, {failed} failed.")
    bad = [c for c in cases if not c["ok"]]
    if bad:
        report.table(sec, "failed cases (first 20)", [
            ("shape", "shape #"), ("kernel", "kernel"), ("batch", "B"), ("kv_heads", "Hkv"), ("group", "g"),
            ("rows", "rows"), ("length", "length"), ("head_dim", "D"), ("dtype", "dtype"), ("bits", "bits"),
            ("gathered", "gathered"), ("mismatches", "mismatches"), ("max_rel_err", "max err / max|ref|"),
            ("error", "error")]).extend(bad[:20])
