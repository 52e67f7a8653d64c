"""Sections 4 and 7's model: a random-init Llama-3.1-8B-shaped model, and section 4 (end to end)."""

from __future__ import annotations

import time

import torch

import kvpress
from kvpress import KVPressCache

from .common import D, Deadline, GIB, HKV, TimeLimit, attempt, copy_bandwidth, free_memory, ints


def llama8b(layers: int, max_positions: int):
    """Llama-3.1-8B shapes, random init directly on the GPU in bf16 (weights do not matter for timing)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def weight_bytes_read(model) -> int:
    """Parameter bytes a decode step reads: everything but the input embedding table (a lookup of B rows)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


class Progress:
    """Counts forwards through the last decoder layer (chunks of a chunked prefill, decode steps), with tokens and
    peak memory; raises TimeLimit there once the deadline has passed."""

    def __init__(self, model, deadline: Deadline | None):
        self.deadline = deadline
        self.calls = self.tokens = 0
        self.log = []
        self.start = time.perf_counter()
        self.handle = model.model.layers[-1].register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        n = hidden.shape[1] if isinstance(hidden, torch.Tensor) else 0
        self.calls += 1
        self.tokens += n
        if n > 1:  # a prefill chunk: log it
            torch.cuda.synchronize()
            self.log.append(dict(chunk=len(self.log) + 1, tokens=self.tokens,
                                 seconds=round(time.perf_counter() - self.start, 2),
                                 peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2)))
        if self.deadline is not None and self.deadline.expired():
            raise TimeLimit(f"time limit after {self.tokens} tokens")

    def remove(self):
        self.handle.remove()


def e2e_policies(context: int):
    return [
        ("none", "none", {}),
        ("snapkv 0.9", "snapkv", dict(compression_ratio=0.9)),
        ("kivi 4-bit", "kivi", dict(bits=4)),
        ("snapkv 0.9 + kivi 4-bit", "snapkv+kivi", dict(compression_ratio=0.9, bits=4)),
        (f"quest (budget {max(512, context // 10)})", "quest", dict(budget=max(512, context // 10))),
    ]


def timed_prefill(model, ids, cache):
    """(logits, seconds) of one prefill into `cache`, the CUDA peak-memory counter reset at its start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    torch.cuda.synchronize()
    return logits, time.perf_counter() - start


def prefill_and_decode(model, policy, params, batch, context, chunk, steps, warmup, deadline):
    """One configuration: prefill (one shot when chunk is None), then `steps` timed decode steps (none if 0)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    progress = Progress(model, deadline)
    row = {}
    try:
        with torch.no_grad(), kvpress.patch_model(model, policy, prefill_chunk_size=chunk, **params):
            cache = KVPressCache(model.config)
            logits, seconds = timed_prefill(model, ids, cache)
            row.update(prefill_s=seconds, peak_gib=torch.cuda.max_memory_allocated() / GIB,
                       kv_gib_after_prefill=cache.nbytes() / GIB)
            if steps:
                token = logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(warmup):  # the first append grows the cache's room; kernels compile
                    token = model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start_ev.record()
                for _ in range(steps):
                    token = model(input_ids=token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                end_ev.record()
                torch.cuda.synchronize()
                stats = cache.stats()
                row.update(step_ms=start_ev.elapsed_time(end_ev) / steps, kv_bytes=cache.nbytes(),
                           kv_gib=cache.nbytes() / GIB, kept_min=min(s["kept_min"] for s in stats),
                           kept_max=max(s["kept_max"] for s in stats),
                           peak_gib=torch.cuda.max_memory_allocated() / GIB)
            del cache, logits
    finally:
        progress.remove()
    return row


def section_e2e(args, device, report, sec, deadline):
    contexts = ints(args.e2e_contexts or ("4096" if args.quick else "32768,65536,131072"))
    batches = ints(args.e2e_batches or "1,8")
    prefill_batches = ints(args.e2e_prefill_batches or "1")
    layers = args.layers or (2 if args.quick else 32)
    steps, warmup = (8, 2) if args.quick else (args.decode_steps, 3)
    chunk = args.chunk or (1024 if args.quick else 8192)
    bw = copy_bandwidth()
    model = llama8b(layers, max(contexts) + steps + warmup + 16)
    weights = weight_bytes_read(model)
    total = torch.cuda.get_device_properties(0).total_memory
    kv_token = 2 * layers * HKV * D * 2  # full bf16 K+V bytes per token and row
    sec["notes"] += [
        f"Random-init Llama-3.1-8B shape: hidden 4096, {layers} layers, 32 heads / 8 KV heads, intermediate 14336, "
        f"vocab 128256, rope theta 500000, bf16, sdpa; random token ids. Weights read per step "
        f"{weights / 1e9:.2f} GB (all parameters but the input embedding).",
        f"decode ms: mean of {steps} steps after {warmup} warm-up steps (CUDA events; one model forward + argmax "
        f"per step, on a KVPressCache). Roofline = (weight bytes + KV bytes read) / copy bandwidth "
        f"({bw / 1e9:,.0f} GB/s); KV bytes read = cache.nbytes() (all stored K/V or codes, positions, state), "
        f"Quest: its budget's K/V rows + fp32 page min/max (16-slot pages).",
        f"Prefill for the decode rows is one shot when it fits, else chunked ({chunk}); the prefill table adds a "
        f"chunked prefill (prefill_chunk_size={chunk}) for batch {prefill_batches}. peak GiB = "
        f"torch.cuda.max_memory_allocated (weights included) over prefill (and decode).",
        "does not fit (estimate): the full bf16 cache + weights exceed 95% of GPU memory (none, quest); others are "
        "tried and caught on CUDA out-of-memory.",
    ]
    decode_rows = report.table(sec, "decode step", [
        ("context", "context"), ("batch", "batch"), ("policy", "policy"), ("prefill", "prefill"),
        ("step_ms", "decode ms/step"), ("tok_s", "tok/s"), ("roofline_ms", "roofline ms"),
        ("pct_roofline", "% of roofline"), ("kv_gib", "KV GiB"), ("kept", "kept/head"), ("status", "status")])
    prefill_rows = report.table(sec, "prefill", [
        ("context", "context"), ("batch", "batch"), ("policy", "policy"), ("oneshot_s", "one-shot s"),
        ("oneshot_peak", "one-shot peak GiB"), ("chunked_s", "chunked s"), ("chunked_peak", "chunked peak GiB"),
        ("kv_oneshot", "KV GiB one-shot"), ("kv_chunked", "KV GiB chunked")])
    try:
        for T in contexts:
            for B in batches:
                for label, policy, params in e2e_policies(T):
                    deadline.check()
                    row = dict(context=T, batch=B, policy=label)
                    decode_rows.append(row)
                    full_cache = B * T * kv_token
                    if policy in ("none", "quest") and weights + full_cache * 1.08 > 0.95 * total:
                        row["status"] = (f"does not fit (estimate: full cache {full_cache / GIB:.0f} GiB + weights "
                                         f"{weights / GIB:.0f} GiB)")
                        if B in prefill_batches:
                            prefill_rows.append(dict(context=T, batch=B, policy=label, oneshot_s="does not fit",
                                                     chunked_s="does not fit"))
                        report.write()
                        continue
                    out, why = attempt(prefill_and_decode, model, policy, params, B, T, None, steps, warmup,
                                       deadline)
                    mode, oneshot_why = "one shot", why
                    if why and why.startswith("does not fit"):
                        mode = f"chunked {chunk}"
                        out, why = attempt(prefill_and_decode, model, policy, params, B, T, chunk, steps, warmup,
                                           deadline)
                    row.update(prefill=mode, status=why or "ok")
                    if out and "step_ms" in out:
                        read = out["kv_bytes"]
                        if policy == "quest":
                            budget = params["budget"]
                            read = B * layers * HKV * (min(budget, T) * 2 * D * 2 + (T // 16) * 2 * D * 4)
                        roof = (weights + read) / bw
                        row.update(step_ms=out["step_ms"], tok_s=B * 1e3 / out["step_ms"], roofline_ms=roof * 1e3,
                                   pct_roofline=100 * roof * 1e3 / out["step_ms"], kv_gib=out["kv_gib"],
                                   kept=f"{out['kept_min']}-{out['kept_max']}", kv_read_bytes=read,
                                   prefill_s=out["prefill_s"], peak_gib=out["peak_gib"])
                    report.write()
                    if B in prefill_batches:
                        prow = dict(context=T, batch=B, policy=label)
                        prefill_rows.append(prow)
                        if out and mode == "one shot":
                            prow.update(oneshot_s=out["prefill_s"], oneshot_peak=out["peak_gib"],
                                        kv_oneshot=out["kv_gib_after_prefill"])
                        else:
                            prow["oneshot_s"] = oneshot_why
                        deadline.check()
                        c, cwhy = attempt(prefill_and_decode, model, policy, params, B, T, chunk, 0, 0, deadline)
                        if c:
                            prow.update(chunked_s=c["prefill_s"], chunked_peak=c["peak_gib"],
                                        kv_chunked=c["kv_gib_after_prefill"])
                        else:
                            prow["chunked_s"] = cwhy
                        report.write()
    finally:
        for r in decode_rows:  # a row the time limit (or a crash) cut short
            r.setdefault("status", "stopped (time limit)")
        for r in prefill_rows:
            r.setdefault("chunked_s", "stopped (time limit)")
        sec["weights_read_bytes"] = weights
        sec["copy_bandwidth_gbs"] = bw / 1e9
        del model
        free_memory()
        _plot_e2e(report.out / "e2e.png", decode_rows)


def _plot_e2e(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({r["batch"] for r in rows if "step_ms" in r})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, B in zip(axes[0], batches):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["context"], r["step_ms"], r["roofline_ms"]) for r in rows
                         if r["batch"] == B and r["policy"] == policy and "step_ms" in r)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", marker="x", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {B} (dotted: roofline)")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode ms / step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
