"""What each policy and ratio costs and saves, against context length: prefill time, decode tokens/s, KV bytes
held after prefill, and peak memory of the whole generate call (RSS on CPU, torch.cuda.max_memory_allocated on
GPU), each as measured in this run. Every config runs alone with a plain patched `generate` (no shared prefill,
unlike kvpress-eval), on the demo's needle prompt, after one warm-up call.

    python benchmarks/policy_costs.py --model smollm2 --lengths 1024,2048,4096 \\
        --policies none,snapkv,h2o,streaming_llm --ratios 0.5,0.75,0.9 --new-tokens 32 --out docs/results/bench

Writes <out>/bench.jsonl, bench.csv, bench.md and memory_vs_context.png (KV bytes after prefill and peak
memory growth, per policy and ratio)."""

from __future__ import annotations

import argparse
import ctypes
import csv
import gc
import json
import re
import time
from pathlib import Path

import torch

import kvpress
from evals.cli import load_model, pick_device
from evals.plan import resolve_model
from evals.engine import configs_for
from kvpress.compressed import TokenClock
from kvpress.needle import needle_prompt


_LIBC = ctypes.CDLL("libc.so.6")


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


class PeakMemory:
    """Peak memory over a block, in bytes above what was held when it started. CPU: the kernel's resident-set
    high-water mark (VmHWM), reset by writing 5 to /proc/self/clear_refs; GPU: max_memory_allocated."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            gc.collect()
            _LIBC.malloc_trim(0)  # hand freed heap back first, so reused pages do not hide this block's peak
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _rss_kib("VmHWM") * 1024
        self.growth = self.peak - self.base
        return False


def measure(model, ids, config, new_tokens: int) -> dict:
    clock = TokenClock()
    with kvpress.patch_model(model, config.make()), PeakMemory(ids.device) as memory:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, streamer=clock)
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
    stats = kvpress.last_cache_stats(model)
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: the prompt; [1]: the first new token
    return dict(policy=config.policy, ratio=config.ratio, n_tokens=ids.shape[1], prefill_s=round(first - start, 3),
                decode_tok_s=round((len(clock.stamps) - 2) / (last - first), 2),
                kv_bytes_after_prefill=stats["prefill_kv_bytes"], cache_bytes_after_prefill=stats["prefill_bytes"],
                peak_bytes=memory.peak, peak_growth_bytes=memory.growth)


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    configs = sorted({(r["policy"], r["ratio"]) for r in rows}, key=lambda c: (c[0] != "none", c))
    policies = sorted({p for p, _ in configs})
    styles = {ratio: style for ratio, style in zip(sorted({r for _, r in configs if r}), ["-", "--", ":", "-."])}
    for policy, ratio in configs:
        pts = sorted((r["n_tokens"], r) for r in rows if (r["policy"], r["ratio"]) == (policy, ratio))
        kw = dict(color=f"C{policies.index(policy)}" if policy != "none" else "black",
                  linestyle=styles.get(ratio, "-"), marker="o", markersize=3,
                  label=policy if policy == "none" else f"{policy} {ratio:.0%}")
        xs = [n for n, _ in pts]
        axes[0].plot(xs, [r["kv_bytes_after_prefill"] / 2**20 for _, r in pts], **kw)
        axes[1].plot(xs, [r["peak_growth_bytes"] / 2**20 for _, r in pts], **kw)
    axes[0].set_title("KV cache held after prefill (MiB)", fontsize=9)
    axes[1].set_title("peak memory growth during generate (MiB)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("context tokens", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows) -> str:
    lines = ["| context | policy | ratio | prefill s | decode tok/s | KV after prefill (MiB) | peak growth (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["n_tokens"], r["policy"] != "none", r["policy"], r["ratio"])):
        lines.append(f"| {r['n_tokens']} | {r['policy']} | {r['ratio']:.2f} | {r['prefill_s']:.2f} | "
                     f"{r['decode_tok_s']:.1f} | {r['kv_bytes_after_prefill'] / 2**20:.1f} | "
                     f"{r['peak_growth_bytes'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--policies", default="none,snapkv,h2o,streaming_llm")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = resolve_model(args.model)
    device = pick_device(args.device)
    model, tokenizer = load_model(path, device, args.dtype), AutoTokenizer.from_pretrained(path)
    configs = configs_for(args.policies.split(","), [float(r) for r in args.ratios.split(",")])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warm = needle_prompt(tokenizer, 256, seed=1).input_ids.to(device)
    for config in configs:  # first calls pay one-time costs (allocator, kernels) that are not the policy's
        measure(model, warm, config, 2)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = needle_prompt(tokenizer, length, depth=0.5, seed=1).input_ids.to(device)
        for config in configs:
            row = measure(model, ids, config, args.new_tokens)
            rows.append(dict(row, device=str(device), threads=torch.get_num_threads()))
            print(json.dumps(rows[-1]), flush=True)
    (out / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "bench.md").write_text(markdown(rows))
    plot(rows, out / "memory_vs_context.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
