"""Section 3: decode kernels' speed against the measured copy bandwidth."""

from __future__ import annotations


import torch
import torch.nn.functional as F

from kvpress.cache.codecs import encode_kivi
from kvpress.kernels.online_softmax import Queries
from kvpress.kernels.sparse_attention import Selection
from kvpress.kernels.triton_quant import lowbit_attention_state_triton
from kvpress.kernels.triton_sparse import sparse_attention_state_triton

from .common import D, HKV, HQ, KIVI_GROUP, Timer, attempt, copy_bandwidth, free_memory, ints


def section_speed(args, device, report, sec, deadline):
    contexts = ints(args.speed_contexts or ("4096,8192" if args.quick else "8192,16384,32768,65536,131072"))
    batches = ints(args.speed_batches or ("1" if args.quick else "1,8"))
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
