"""Section 7: captured decode steps (torch.compile + CUDA graphs), kvpress beside StaticCache."""

from __future__ import annotations

import time

import torch

import kvpress
from kvpress import KVPressCache

from .common import D, GIB, HKV, attempt, copy_bandwidth, free_memory, ints
from .model import e2e_policies, llama8b, weight_bytes_read


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
    contexts = ints(args.e2e_contexts or ("4096" if args.quick else "32768,131072"))
    batches = ints(args.e2e_batches or "1,8")
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
