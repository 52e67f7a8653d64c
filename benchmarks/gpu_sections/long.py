"""Section 5: a 1,000,000-token context, chunked prefill with compression and low-bit storage."""

from __future__ import annotations

import time
import traceback

import torch

import kvpress
from kvpress import KVPressCache

from .common import D, Deadline, GIB, HKV, TimeLimit, free_memory
from .model import Progress, llama8b, timed_prefill


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
