"""Fidelity of low-bit KV storage on SmolLM2: mean NLL of a held-out continuation after a ~4K-token context.

The context is prefilled through the patched model (attention exact, then the cache is stored low-bit); the
continuation is then scored in one forward that reads the stored cache (teacher forcing). Compared: full
cache, KIVI-4, KIVI-2, GEAR-2 (same group size and residual for all), and SnapKV 75% + KIVI-2.

    python benchmarks/quant_fidelity.py [--text FILE] [--context 4000] [--continuation 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvpress
from kvpress.models import load

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # natural English prose present on Debian machines


def continuation_nll(model, context, continuation, policy, **params) -> tuple[float, int]:
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        cache = kvpress.KVPressCache(model.config)
        model(context, past_key_values=cache)
        bytes_after_prefill = sum(row["kv_bytes"] for row in cache.stats())
        logits = model(continuation, past_key_values=cache).logits
    # token i of the continuation is predicted by the logits at i-1 (and the first by the context's last)
    first = logits[:, :-1].float()
    targets = continuation[:, 1:]
    return F.cross_entropy(first.reshape(-1, first.shape[-1]), targets.reshape(-1)).item(), bytes_after_prefill


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--start", type=int, default=0, help="first token of the context in the text")
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--residual", type=int, default=128)
    args = parser.parse_args(argv)

    model, tok = load("smollm2")
    ids = tok(open(args.text).read(), return_tensors="pt").input_ids
    need = args.start + args.context + args.continuation + 1
    if ids.shape[1] < need:
        raise ValueError(f"--text has {ids.shape[1]} tokens; allowed: a text of at least {need} tokens")
    ids = ids[:, args.start:]
    context = ids[:, : args.context]
    continuation = ids[:, args.context - 1: args.context + args.continuation]  # overlaps by one: see above
    codec = dict(group_size=args.group_size, residual_length=args.residual)
    configs = [
        ("full cache", "none", {}),
        ("kivi-4", "kivi", dict(bits=4, **codec)),
        ("kivi-2", "kivi", dict(bits=2, **codec)),
        ("gear-2", "gear", dict(bits=2, **codec)),
        ("gear-l-2 (no outliers)", "gear", dict(bits=2, outlier_ratio=0.0, **codec)),
        ("snapkv 75% + kivi-2", "snapkv+kivi", dict(compression_ratio=0.75, bits=2, **codec)),
    ]
    print(f"SmolLM2-135M-Instruct fp32 | context {args.context} tokens of {args.text} | held-out continuation "
          f"{args.continuation} tokens | group {args.group_size}, residual {args.residual}\n")
    print(f"{'config':<24} {'mean NLL':>9} {'delta':>8} {'KV bytes':>12} {'ratio':>6} {'time s':>7}")
    base = base_bytes = None
    for label, policy, params in configs:
        start = time.perf_counter()
        nll, nbytes = continuation_nll(model, context, continuation, policy, **params)
        base = nll if base is None else base
        base_bytes = nbytes if base_bytes is None else base_bytes
        print(f"{label:<24} {nll:>9.4f} {nll - base:>+8.4f} {nbytes:>12,} {nbytes / base_bytes:>6.3f} "
              f"{time.perf_counter() - start:>7.1f}", flush=True)
    print("\nKV bytes: keys/values storage after prefill (codes, scales, GEAR factors, full-precision residual)"
          "; the model is fp32, so ratios are against an fp32 cache.")


if __name__ == "__main__":
    main()
