"""Decode speed of the read views against the full cache, on one prefill: the prompt is prefilled once (policy none),
then each view decodes greedy tokens on its own fork of that cache, and the full cache does the same
unpatched-policy run ("none"). Each config first decodes `--count-steps` untimed steps that count what it reads; then the
configs take turns, `--rounds` rounds of new_tokens / rounds steps each, so a slow spell of a shared machine falls on
every config alike. Prints per config: ms per decode step (the median of its rounds' median steps), tokens per
second, the ratio to the full cache (the median of the per-round ratios, and each round's), the fraction of the
stored slots attention read per step (averaged over layers, KV heads and the counting steps; what a selector reads
to decide is not in it), and the bytes each view holds besides the cache (its read-side state in layer.derived:
page statistics, label caches, selections).

    python benchmarks/read_view_speed.py --lengths 8192,16384 --budget-fraction 0.1 --new-tokens 32 \
        --views quest,retrieval,token_select,recycled_attention,hip,tidal_decode,lserve,double_sparsity
    # a view's other parameters after colons, as the evals take them: double_sparsity:group_factor=4:dense_layers=0

A view that observes the prompt (recycled_attention builds its first partial set from the prompt's last token)
sees a prefill it did not run: its first step is then a full one, as when it drafts for another target.
Only kvpress's public API is used (and the evals' policy-spec parser).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvpress
from evals.engine import parse_policy
from kvpress import KVPressCache
from kvpress.needle import needle_prompt


def _state_bytes(cache) -> int:
    """Bytes of every layer's read-side state (layer.derived: tensors held by its values)."""
    total = 0
    for _, layer in cache.kvpress_layers():
        for value in layer.derived.values():
            for held in vars(value).values():  # a tensor, or a tuple of them (a label cache's buffers)
                for t in held if isinstance(held, (tuple, list)) else (held,):
                    total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    return total


def decode(model, cache, token, steps: int, view: str | None, params: dict, count_reads: bool = False):
    """(per-step seconds, the mean fraction of stored slots read (1.0 for the full cache; None unless
    count_reads: counting costs time, so timed steps do not count), the last token)."""
    reads = []
    name, spec_params = parse_policy(view) if view else (None, {})
    params = {**params, **spec_params}
    view_type = kvpress.policies.get_policy_class(name) if view else None
    real_select = view_type.select if view_type else None
    if view_type and count_reads:
        def counting(self, ctx):
            indices, valid = real_select(self, ctx)
            held = ctx.layer.key_valid().sum(-1).float()
            reads.append(float(((valid & ctx.layer.key_valid().gather(-1, indices)).sum(-1) / held).mean()))
            return indices, valid
        view_type.select = counting
    times = []
    try:
        with kvpress.patch_model(model, name or "none", **params), torch.no_grad():
            for _ in range(steps):
                start = time.perf_counter()
                logits = model(token, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
    finally:
        if view_type:
            view_type.select = real_select
    read = (sum(reads) / len(reads) if reads else 1.0) if count_reads else None
    return times, read, token


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--budget-fraction", type=float, default=0.1, help="each view's budget: this fraction of the prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--views", default="quest,retrieval,token_select,recycled_attention,hip,tidal_decode,lserve,"
                                      "double_sparsity")
    p.add_argument("--count-steps", type=int, default=10, help="untimed steps first, counting what each view reads")
    p.add_argument("--rounds", type=int, default=4, help="turns each config takes, new_tokens / rounds steps each")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    for length in map(int, args.lengths.split(",")):
        ids = needle_prompt(tok, length, seed=1).input_ids
        prompt = KVPressCache(model.config)
        with kvpress.patch_model(model, "none"), torch.no_grad():
            first = model(ids, past_key_values=prompt, use_cache=True).logits[:, -1:].argmax(-1)
        budget = int(args.budget_fraction * ids.shape[1])
        configs = [None] + args.views.split(",")
        params = {view: {} if view is None else dict(budget=budget) for view in configs}
        caches, tokens, reads = {view: prompt.fork() for view in configs}, dict.fromkeys(configs, first), {}
        for view in configs:  # untimed steps, counting what the view reads (recycled_attention: one full in 10)
            _, reads[view], tokens[view] = decode(model, caches[view], first, args.count_steps, view, params[view],
                                                  True)
        # the configs take turns, round after round: a slow spell of a shared machine slows every config's round
        times = {view: [] for view in configs}
        ratios = {view: [] for view in configs}
        per_round = max(1, args.new_tokens // args.rounds)
        for _ in range(args.rounds):
            for view in configs:
                steps, _, tokens[view] = decode(model, caches[view], tokens[view], per_round, view, params[view])
                times[view].append(statistics.median(steps))
            for view in configs:
                ratios[view].append(times[None][-1] / times[view][-1])
        for view in configs:
            ms = statistics.median(times[view]) * 1000
            row = dict(length=ids.shape[1], view=view or "none (full cache)", budget=None if view is None else budget,
                       ms_per_step=round(ms, 1), tok_s=round(1000 / ms, 2),
                       vs_full=round(statistics.median(ratios[view]), 2),
                       vs_full_rounds=[round(r, 2) for r in ratios[view]], read_fraction=round(reads[view], 3),
                       state_bytes=_state_bytes(caches[view]), cache_bytes=caches[view].nbytes(),
                       threads=args.threads, dtype=args.dtype)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
