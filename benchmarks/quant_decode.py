"""Low-bit decode attention: speed against dense sdpa decode, and true KV bytes against an fp16 cache.

8B-class shapes (32 query heads, 8 KV heads, head_dim 128), one decode query, KIVI group 32 / residual 128.
- GPU (CUDA): bf16, contexts 8K/32K/128K; the Triton kernel vs sdpa over the dense bf16 cache; achieved
  bytes/s (packed bytes the kernel must read) as a fraction of the HBM peak (--hbm-tbps, H100 SXM: 3.35).
- CPU: fp32, small contexts, with the torch reference (the Triton kernel only runs interpreted on CPU).
Memory: KVPressLayer.kv_nbytes() at 8K tokens (fp16 K/V) for KIVI-2/4, GEAR-2 and SnapKV 75% + KIVI-2,
against the fp16 cache, and against the configuration's theoretical size. Prints tables; asserts nothing.

    python benchmarks/quant_decode.py [--contexts 2048,8192] [--bits 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvpress import KVPressLayer
from kvpress.kernels.online_softmax import Queries
from kvpress.policies import GEAR, KIVI, SnapKV
from kvpress.policies.base import Context

HQ, HKV, D, G, R = 32, 8, 128, 32, 128


def timed(fn, reps):
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps / 1e3
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def speed_table(contexts, bits, hbm_tbps):
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = "triton" if cuda else "torch reference"  # what KVPressLayer.attention picks for KIVI codes here
    print(f"decode attention, {HQ}q/{HKV}kv heads, head_dim {D}, KIVI-{bits} g{G} r{R}, {dtype}, {dev} ({name})")
    print(f"{'context':>8} {'dense sdpa ms':>14} {'low-bit ms':>11} {'speedup':>8} {'bytes read':>12} "
          f"{'GB/s':>8} {'% HBM peak':>10}")
    for n in contexts:
        torch.manual_seed(0)
        k = torch.randn(1, HKV, n, D, device=dev, dtype=dtype)
        v = torch.randn(1, HKV, n, D, device=dev, dtype=dtype)
        q = torch.randn(1, HQ, 1, D, device=dev, dtype=dtype)
        layer = KVPressLayer()
        layer.update(k, v)
        KIVI(bits=bits, group_size=G, residual_length=R).store(layer)
        queries = Queries(q, torch.tensor([n - 1], device=dev), D ** -0.5)
        reps = 20 if cuda else 3
        dense = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps)
        low = timed(lambda: layer.attention(queries), reps)
        read = layer.kv_nbytes()
        gbs = read / low / 1e9
        peak = f"{100 * gbs / (hbm_tbps * 1e3):>9.1f}%" if cuda else f"{'n/a (cpu)':>10}"
        print(f"{n:>8} {dense * 1e3:>14.3f} {low * 1e3:>11.3f} {dense / low:>7.2f}x {read:>12,} {gbs:>8.1f} {peak}",
              flush=True)
        del k, v, layer


def memory_table(n=8192, heads=HKV, dim=D):
    torch.manual_seed(0)
    k = torch.randn(1, heads, n, dim, dtype=torch.float16)
    v = torch.randn(1, heads, n, dim, dtype=torch.float16)
    q = torch.randn(1, heads * 4, n, dim, dtype=torch.float16)
    full = 2 * k.numel() * 2
    print(f"\nKV bytes at {n} tokens, {heads} KV heads x head_dim {dim}, fp16 K/V (full cache: {full:,} bytes)")
    print(f"{'config':<26} {'bytes':>12} {'x fp16':>7} {'theory':>12} {'nbytes/theory':>14}")

    def run(label, policies, theory):
        layer = KVPressLayer()
        layer.update(k, v)
        ctx = Context(layer_idx=0, layer=layer, phase="prefill", query=q[:, :, -64:],
                      scaling=dim ** -0.5)
        for p in policies:
            p.observe(ctx)
            p.on_prefill(ctx)
        got = layer.kv_nbytes()
        ratio = f"{got / theory:>14.3f}" if theory else f"{'':>14}"
        print(f"{label:<26} {got:>12,} {got / full:>7.3f} {theory or 0:>12,} {ratio}")

    def kivi_theory(kept, bits, group=G, residual=R):
        n_q = ((kept - residual) // group) * group
        codes = 2 * n_q * dim * bits // 8
        scales = 2 * (n_q // group) * dim * 2 + 2 * n_q * (dim // group) * 2  # fp16 scale + min, K and V
        return heads * (codes + scales + (kept - n_q) * dim * 2 * 2)

    run("KIVI-2 (g32, r128)", [KIVI(bits=2)], kivi_theory(n, 2))
    run("KIVI-4 (g32, r128)", [KIVI(bits=4)], kivi_theory(n, 4))
    run("GEAR-2 (g64, r64, rank 2)", [GEAR()], None)
    run("SnapKV 75% + KIVI-2", [SnapKV(compression_ratio=0.75), KIVI(bits=2)], None)
    print("(SnapKV rows add the kept tokens' original positions: int32 per slot and head, counted in bytes)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default=None, help="comma-separated; default 8K,32K,128K on GPU, 1K,4K on CPU")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM peak of the GPU in TB/s")
    args = parser.parse_args(argv)
    default = "8192,32768,131072" if torch.cuda.is_available() else "1024,4096"
    speed_table([int(x) for x in (args.contexts or default).split(",")], args.bits, args.hbm_tbps)
    memory_table()


if __name__ == "__main__":
    main()
