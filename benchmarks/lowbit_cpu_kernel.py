"""The CPU low-bit kernel (kvpress/kernels/lowbit_cpu.c) alone: one decode step's attention over one layer of
KIVI / GEAR codes, against sdpa over the same tokens in fp32 (what the full cache reads), in one run.

SmolLM2-135M's shape by default (3 KV heads, 3 query heads each, head_dim 64), rectangular codes of `--slots`
tokens per head, one query row per head, torch's threads (`--threads`). Prints ms per call (the fastest of 5
rounds) and the ratio to sdpa; asserts nothing.

    python benchmarks/lowbit_cpu_kernel.py [--batch 4] [--slots 4096] [--threads 2] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvpress.cache.codecs import encode_gear, encode_kivi
from kvpress.kernels import lowbit_native
from kvpress.kernels.online_softmax import Queries


def per_call_ms(fn, rounds: int = 5, seconds: float = 0.3) -> float:
    """The fastest round's mean: other work on the machine only ever slows a round down."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e3 * best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--slots", type=int, default=4096)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not lowbit_native.available():
        raise SystemExit("the C kernel could not be built on this machine (see the warning above)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, t, d = args.batch, args.kv_heads, args.slots, args.head_dim
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    valid = torch.ones(b, h, t, dtype=torch.bool)
    q = torch.randn(b, h * args.group, 1, d)
    queries = Queries(q, torch.full((b, 1), t), d ** -0.5)
    positions = torch.arange(t, dtype=torch.int32).expand(b, h, t)
    dense = per_call_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    print(f"batch {b}, {h} KV heads x {args.group} query heads, head_dim {d}, {t} slots, {args.threads} threads")
    print(f"{'':28} {'ms/call':>8} {'vs sdpa fp32':>13}")
    print(f"{'sdpa over fp32 K/V':28} {dense:8.3f} {1.0:13.2f}")
    for name, codes in (("KIVI 4-bit", encode_kivi(k, v, valid, 4, 32)), ("KIVI 2-bit", encode_kivi(k, v, valid, 2, 32)),
                        ("GEAR 4-bit (rank 2, 2%)", encode_gear(k, v, valid, 4, 32, 2, 0.02, 3)),
                        ("GEAR 2-bit (rank 2, 2%)", encode_gear(k, v, valid, 2, 32, 2, 0.02, 3))):
        ms = per_call_ms(lambda: lowbit_native.lowbit_attention_state_native(queries, codes, positions))
        print(f"{name:28} {ms:8.3f} {dense / ms:13.2f}")


if __name__ == "__main__":
    main()
