"""Where a decode step's time goes on a CUDA GPU: the Llama-3.1-8B-shaped model of gpu_suite.py (random init,
bf16, few layers), one prompt, each policy; per step: wall time with the host free-running (what a user gets),
GPU-busy time (CUDA events around kernels only would hide host gaps, so a torch.profiler trace gives the device
total), and the top operators by host and by device time. Prints one table per policy and a summary.

    python3 benchmarks/gpu_profile.py --context 4096 --layers 2 --policies none,snapkv,kivi,quest
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import kvpress
from benchmarks.gpu_sections.model import e2e_policies, llama8b
from kvpress import KVPressCache


def step(model, token, cache):
    return model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)


def profile_policy(model, label, policy, params, batch, context, steps, top):
    """policy None: the model unpatched on transformers' DynamicCache (params: {"cudnn": False} runs it with
    torch's cuDNN attention backend switched off)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    if policy is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers import DynamicCache
        patch = contextlib.nullcontext() if params.get("cudnn", True) else sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        make_cache = DynamicCache
    else:
        patch, make_cache = kvpress.patch_model(model, policy, **params), lambda: KVPressCache(model.config)
    with torch.no_grad(), patch:
        cache = make_cache()
        token = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            token = step(model, token, cache)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            token = step(model, token, cache)
        host_s = time.perf_counter() - start  # the host's own time to issue the steps
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                token = step(model, token, cache)
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / steps
    print(f"\n=== {label}: batch {batch}, context {context}: wall {wall_s / steps * 1e3:.2f} ms/step, host issue "
          f"{host_s / steps * 1e3:.2f} ms/step, device busy {device_us / 1e3:.2f} ms/step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))
    return dict(policy=label, wall_ms=wall_s / steps * 1e3, host_ms=host_s / steps * 1e3, device_ms=device_us / 1e3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--policies", default=None, help="first words of the labels: vanilla (transformers unpatched, with "
                   "and without cuDNN attention), then gpu_sections.model.e2e_policies's; default all")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_profile.py needs CUDA")
    model = llama8b(args.layers, args.context + 64)
    wanted = None if args.policies is None else args.policies.split(",")
    runs = [("vanilla", None, {}), ("vanilla, cuDNN attention off", None, {"cudnn": False})]
    runs += e2e_policies(args.context)
    rows = [profile_policy(model, label, policy, params, args.batch, args.context, args.steps, args.top)
            for label, policy, params in runs if wanted is None or label.split()[0].strip(",") in wanted]
    print("\n| policy | wall ms/step | host issue ms/step | device busy ms/step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['wall_ms']:.2f} | {r['host_ms']:.2f} | {r['device_ms']:.2f} |")


if __name__ == "__main__":
    main()
