"""Peak memory of a prefill vs context length: one-shot vs chunked prefill, with and without compression.

Each (mode, length) runs in a fresh process, so peaks do not leak between runs. On CPU the figure is peak RSS
above the RSS once the model is loaded, its memory-mapped weights paged in and an 8-token warm-up forward
run (the weights and one-time set-up); the kernel's high-water mark is reset then (/proc/self/clear_refs), so
loading transients are not counted. On GPU it is torch.cuda.max_memory_allocated
above the allocated bytes after loading.

Children run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, --mmap-threshold, default 64 KiB):
by default glibc raises that threshold as large blocks are freed, then serves tensors from its heap and keeps
freed ones there, so RSS counts memory the program no longer holds (a chunked prefill frees and reallocates
every layer's cache each chunk). With the threshold fixed, freed tensors go back to the OS and peak RSS
tracks live memory, like max_memory_allocated on GPU. `--mmap-threshold 0` measures the default allocator.

  python benchmarks/prefill_memory.py                       # SmolLM2, 2K/4K/8K, writes docs/results/prefill_memory
  python benchmarks/prefill_memory.py --lengths 8192 --chunk 1024 --ratio 0.9
  python benchmarks/prefill_memory.py --lengths 4096,8192 --modes "one-shot full cache,one-shot kvzip,chunked kvzip" \
      --ratio 0.75 --chunk 2048 --out docs/results/kvzip_prefill   # KVzip's replay: time and peak
  python benchmarks/prefill_memory.py --model random-8b --device cuda --dtype bfloat16 --lengths 16384,65536

`--model random-8b` builds a random-initialised Llama-3-8B-shaped model (no download; GPU only in practice).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {
    "one-shot full cache": dict(policy="none", chunk=False),
    "one-shot snapkv": dict(policy="snapkv", chunk=False),
    "chunked snapkv": dict(policy="snapkv", chunk=True),
    "one-shot kvzip": dict(policy="kvzip", chunk=False),
    "chunked kvzip": dict(policy="kvzip", chunk=True),
}
DEFAULT_MODES = "one-shot full cache,one-shot snapkv,chunked snapkv"


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _load(name, device, dtype):
    import torch

    if name == "random-8b":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                             rope_theta=500000.0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        return model.eval()
    from kvpress.models import load

    return load(name, dtype=dtype)[0].to(device).eval()


def child(args) -> dict:
    import torch

    import kvpress
    from kvpress import KVPressCache

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = _load(args.model, args.device, dtype)
    mode = MODES[args.mode]
    ids = torch.randint(10, 1000, (1, args.length), generator=torch.Generator().manual_seed(0)).to(args.device)
    cuda = args.device.startswith("cuda")
    with torch.no_grad():  # page in memory-mapped weights and run one-time kernel set-up before the baseline
        for param in model.parameters():
            param.sum()
        model(input_ids=ids[:, :8])
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the RSS high-water mark
        base = _rss_bytes("VmRSS")
    params = dict(compression_ratio=args.ratio) if mode["policy"] != "none" else {}
    chunk = args.chunk if mode["chunk"] else None
    start = time.perf_counter()
    with torch.no_grad(), kvpress.patch_model(model, mode["policy"], prefill_chunk_size=chunk, **params):
        cache = KVPressCache(model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    seconds = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _rss_bytes("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(mode=args.mode, length=args.length, peak_above_weights=peak - base, base=base, weights=weights,
                kv_bytes_after=sum(row["kv_bytes"] for row in cache.stats()), prefill_s=round(seconds, 2),
                chunk=chunk, ratio=args.ratio if params else 0.0, device=args.device, model=args.model)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--ratio", type=float, default=0.9)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="docs/results/prefill_memory")
    p.add_argument("--mmap-threshold", type=int, default=65536,
                   help="MALLOC_MMAP_THRESHOLD_ for the measured processes; 0: glibc's default (dynamic)")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {list(MODES)}")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:  # child process: one measurement, printed as JSON
        print("RESULT " + json.dumps(child(args)))
        return

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: {unknown} unknown; allowed values: {list(MODES)}")
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--length", str(length)] + [
                f"--{k}={v}" for k, v in dict(model=args.model, chunk=args.chunk, ratio=args.ratio, device=args.device,
                                              dtype=args.dtype, threads=args.threads).items()]
            env = dict(os.environ)
            if args.mmap_threshold:
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if out.returncode or not line:
                raise RuntimeError(f"{mode} at {length}: {out.stderr[-2000:]}")
            rows.append(json.loads(line[0][7:]))
            r = rows[-1]
            print(f"{length:>7} {mode:<22} peak above weights {r['peak_above_weights'] / 2**20:9.1f} MiB   "
                  f"KV after {r['kv_bytes_after'] / 2**20:8.1f} MiB   prefill {r['prefill_s']:6.1f} s", flush=True)

    print()
    print("| prompt tokens | mode | peak above weights (MiB) | vs one-shot full cache | KV after prefill (MiB) | "
          "prefill s (vs full) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        full = next((x for x in rows if x["length"] == r["length"] and x["mode"] == "one-shot full cache"), r)
        print(f"| {r['length']} | {r['mode']} | {r['peak_above_weights'] / 2**20:.1f} | "
              f"{r['peak_above_weights'] / full['peak_above_weights']:.2f} | {r['kv_bytes_after'] / 2**20:.1f} | "
              f"{r['prefill_s']} ({r['prefill_s'] / full['prefill_s']:.2f}x) |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    _plot(rows, os.path.join(args.out, "peak_memory_vs_context.png"), args, modes)


def _plot(rows, path, args, modes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        pts = sorted((r["length"], r["peak_above_weights"] / 2**20) for r in rows if r["mode"] == mode)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak memory above weights (MiB)")
    ax.set_title(f"{args.model} prefill, {args.device}: ratio {args.ratio:.0%}, chunk {args.chunk}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
