"""ShadowKV's two tiers against the full cache on CPU: one prefill per config and length, then `--new-tokens` greedy
decode steps. Prints per config: ms per decode step (median of the steps after the first two), tokens per second,
the ratio to the full cache, the bytes held in memory (the primary tier: low-rank key factors, landmarks, exact
outlier and local chunks, the generated tokens) and in the file tier (the values), both as a share of the full
cache's bytes, the slots a step reads per KV head, and the time per step spent fetching values from the file tier
(inside the step's time).

    python benchmarks/shadowkv_tiers.py --lengths 8192,16384 --budget-fraction 0.08 --outlier-fraction 0.0117 \
        --new-tokens 24

The file tier's pages are in the OS page cache right after they are written and read; this measures the reads
without a drop of that cache, so it is the time of a warm tier. Only kvpress's public API is used (and ShadowKV's
storage class, to time its fetches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.cache.shadow import ShadowKeys
from kvpress.needle import needle_prompt


def run(model, ids, steps: int, policy: str, params: dict):
    """(per-step seconds, per-step fetch seconds, cache after prefill and decoding)."""
    fetches, real_fetch = [], ShadowKeys.fetch_values

    def timed(self, slots):
        start = time.perf_counter()
        out = real_fetch(self, slots)
        fetches.append(time.perf_counter() - start)
        return out

    ShadowKeys.fetch_values = timed
    cache, times, per_step = KVPressCache(model.config), [], []
    try:
        with kvpress.patch_model(model, policy, **params), torch.no_grad():
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(steps):
                fetches.clear()
                start = time.perf_counter()
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
                per_step.append(sum(fetches))
    finally:
        ShadowKeys.fetch_values = real_fetch
    return times, per_step, cache


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--budget-fraction", type=float, default=0.08, help="selected chunks: this fraction of the prompt")
    p.add_argument("--outlier-fraction", type=float, default=0.0117,
                   help="outlier chunks' tokens: this fraction of the prompt (the paper: 48 x 8 of 32K)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    c = args.chunk_size
    for length in map(int, args.lengths.split(",")):
        ids = needle_prompt(tok, length, seed=1).input_ids
        n = ids.shape[1]
        params = dict(budget=max(c, int(args.budget_fraction * n) // c * c), chunk_size=c,
                      outlier_chunks=max(0, round(args.outlier_fraction * n / c)))
        full = full_bytes = None
        for policy in ("none", "shadowkv"):
            times, fetch, cache = run(model, ids, args.new_tokens, policy, {} if policy == "none" else params)
            ms = statistics.median(times[2:]) * 1000
            full, full_bytes = full or ms, full_bytes or cache.nbytes()
            layers = [layer for _, layer in cache.kvpress_layers()]
            reads = layers[0].segments[0].data.read_slots() + layers[0].tail.width if policy == "shadowkv" else n
            row = dict(length=n, policy=policy, params={} if policy == "none" else params, ms_per_step=round(ms, 1),
                       tok_s=round(1000 / ms, 2), vs_full=round(full / ms, 2),
                       memory_bytes=cache.nbytes(), memory_share=round(cache.nbytes() / full_bytes, 4),
                       file_bytes=cache.offloaded_nbytes(), file_share=round(cache.offloaded_nbytes() / full_bytes, 4),
                       slots_read_per_head=reads, read_share=round(reads / (n + args.new_tokens), 4),
                       fetch_ms_per_step=round(statistics.median(fetch[2:]) * 1000, 2),
                       threads=args.threads, dtype=args.dtype)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
