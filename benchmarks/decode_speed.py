"""Decode speed of compressed caches against the full cache, with a per-step breakdown (attention, policy
hooks = scoring + eviction, append), all measured in one run.

Only kvpress's public API is used (patch_model, generate, last_cache_stats), plus timing wrappers around the
registered attention function, the patched policy's hooks and KVPressCache.update, so the same script measures
an older checkout too (run it with PYTHONPATH pointing at that checkout):

    python benchmarks/decode_speed.py --length 8192 --new-tokens 128 --ratios 0.75,0.9 --out docs/results/decode_speed
    python benchmarks/decode_speed.py --length 4096 --batch 4 ...          # 4 left-padded prompts
    python benchmarks/decode_speed.py --long-run 1000 --policies h2o --budget 512   # bytes and tok/s over a run

decode tok/s counts generated tokens (x batch) after the first one, timed by a streamer inside `generate`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.compressed import TokenClock
from kvpress.needle import needle_prompt
from evals.engine import parse_policy


class Timers:
    """Seconds spent in decode steps (one query token) by the attention function, the policy's hooks and the
    cache's appends; attention excludes the hooks it calls."""

    def __init__(self):
        self.total = defaultdict(float)
        self.steps = 0

    def wrap(self, fn, name, decode_only):
        def timed(*args, **kwargs):
            if not decode_only(*args, **kwargs):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
        return timed


def _instrument(model, patch, timers: Timers):
    """Install the timing wrappers; returns a function that removes them."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS[name]
    AttentionInterface.register(name, timers.wrap(attention, "attention+hooks", lambda m, q, *a, **k: q.shape[2] == 1))
    policy = patch.policy
    saved = {}
    for hook in ("on_decode", "observe"):
        if hasattr(policy, hook):
            saved[hook] = policy.__dict__.get(hook)
            setattr(policy, hook, timers.wrap(getattr(policy, hook), "hooks", lambda ctx: ctx.q_len == 1))
    update = KVPressCache.update
    KVPressCache.update = timers.wrap(update, "append", lambda self, k, v, *a, **kw: k.shape[2] == 1)

    def remove():
        AttentionInterface.register(name, attention)
        for hook, previous in saved.items():
            if previous is None:
                delattr(policy, hook)
            else:
                setattr(policy, hook, previous)
        KVPressCache.update = update
    return remove


def run(model, ids, mask, policy, params, new_tokens, breakdown=True) -> dict:
    clock = TokenClock()
    timers = Timers()
    with torch.no_grad(), kvpress.patch_model(model, policy, **params) as patch:
        remove = _instrument(model, patch, timers) if breakdown else (lambda: None)
        try:
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, streamer=clock)
        finally:
            remove()
    stats = kvpress.last_cache_stats(model)
    first, last = clock.stamps[1], clock.stamps[-1]
    steps = len(clock.stamps) - 2
    decode_s = last - first
    per_step = {k: 1e3 * v / steps for k, v in timers.total.items()}
    if breakdown:
        per_step["attention"] = per_step.pop("attention+hooks", 0.0) - per_step.get("hooks", 0.0)
        per_step["rest of the model"] = 1e3 * decode_s / steps - per_step["attention"] - per_step.get("hooks", 0.0) \
            - per_step.get("append", 0.0)
    options = {k: v for k, v in params.items() if k not in ("compression_ratio", "budget")}
    return dict(policy=policy, options=options, ratio=params.get("compression_ratio", 0.0), budget=params.get("budget"),
                batch=ids.shape[0], prompt=ids.shape[1], prefill_s=round(first - start, 2),
                decode_tok_s=round(steps * ids.shape[0] / decode_s, 2), ms_per_step={k: round(v, 2) for k, v in
                                                                               per_step.items()},
                kv_bytes_after_prefill=stats["prefill_kv_bytes"], kv_bytes_end=stats["kv_bytes"])


def long_run(model, ids, policy, params, new_tokens, window=100) -> dict:
    """Bytes held and tok/s over a long generation, per window of `window` tokens."""
    marks, sizes = [], []
    with torch.no_grad(), kvpress.patch_model(model, policy, **params):
        cache = KVPressCache(model.config)
        logits = model(ids, past_key_values=cache).logits[:, -1]
        start = time.perf_counter()
        for step in range(new_tokens):
            logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
            if (step + 1) % window == 0:
                marks.append(time.perf_counter())
                sizes.append(cache.nbytes())
    rates = [window / (b - a) for a, b in zip([start] + marks[:-1], marks)]
    return dict(policy=policy, options={k: v for k, v in params.items() if k != "budget"}, budget=params["budget"],
                tokens=new_tokens, window=window,
                tok_s_per_window=[round(r, 2) for r in rates], bytes_per_window=sizes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--policies", default="snapkv,h2o,tova,streaming_llm,knorm,expected_attention,keydiff")
    p.add_argument("--ratios", default="0.75,0.9")
    p.add_argument("--codecs", default="", help="comma list of storage-only specs run once each, e.g. kivi:bits=4,gear")
    p.add_argument("--batch", type=int, default=1, help="rows; rows after the first are left-padded shorter prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per config; the fastest is kept")
    p.add_argument("--long-run", type=int, default=0, help="tokens of one long generation per policy (with --budget)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--label", default="", help="a name for this checkout in the output rows")
    p.add_argument("--out", default=None, help="append rows to <out>/results.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    available = set(kvpress.list_policies())
    policies = [parse_policy(x) for x in args.policies.split(",") if x]  # specs: "h2o" or "h2o:slack=32"
    unknown = [name for name, _ in policies if any(part not in available for part in name.split("+"))]
    if unknown:
        raise SystemExit(f"--policies: unknown {unknown}; allowed values: {sorted(available)}, with :key=value options")
    rows = []
    if args.long_run:
        ids = needle_prompt(tok, args.length, seed=1).input_ids
        for policy, params in policies:
            rows.append(dict(long_run(model, ids, policy, dict(params, budget=args.budget), args.long_run),
                             label=args.label))
            print(json.dumps(rows[-1]), flush=True)
    else:
        prompts = [needle_prompt(tok, args.length - 37 * i, seed=1 + i).input_ids[0] for i in range(args.batch)]
        width = max(len(x) for x in prompts)
        ids = torch.zeros(args.batch, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(prompts):
            ids[i, width - len(x):], mask[i, width - len(x):] = x, 1
        warm = needle_prompt(tok, 256, seed=9).input_ids
        run(model, warm, torch.ones_like(warm), "none", {}, 4, breakdown=False)
        configs = [("none", {})] + [(pol, dict(params, compression_ratio=r)) for pol, params in policies
                                    for r in map(float, args.ratios.split(","))]
        configs += [parse_policy(x) for x in args.codecs.split(",") if x]
        full = None
        for policy, params in configs:
            best = max((run(model, ids, mask, policy, params, args.new_tokens) for _ in range(args.repeats)),
                       key=lambda r: r["decode_tok_s"])
            full = full or best["decode_tok_s"]
            best.update(vs_full=round(best["decode_tok_s"] / full, 2), label=args.label, threads=args.threads)
            rows.append(best)
            print(json.dumps(best), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
