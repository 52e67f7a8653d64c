"""What a read view reads per decode step, measured: the fraction of each layer's stored slots that attention reads
(averaged over layers, KV heads and steps), and the bytes each view holds besides the cache (its read-side state:
page statistics, label caches). One needle prompt, greedy decoding; the views' `select` is wrapped to count.

    python benchmarks/read_fraction.py --length 4096 --new-tokens 16 \
        --views quest:budget=410,retrieval:budget=410,token_select:budget=410,recycled_attention:budget=410,\
hip:budget=410,tidal_decode:budget=410,lserve:budget=410,double_sparsity:budget=410

Only kvpress's public API is used (patch_model, KVPressCache, the policy classes' select).
"""

from __future__ import annotations

import argparse
import json

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.needle import needle_prompt
from evals.engine import parse_policy


def _state_bytes(cache) -> int:
    """Bytes of every layer's read-side state (layer.derived: tensors held by its values)."""
    total = 0
    for _, layer in cache.kvpress_layers():
        for value in layer.derived.values():
            total += sum(t.numel() * t.element_size() for t in vars(value).values() if isinstance(t, torch.Tensor))
    return total


def measure(model, ids, spec: str, new_tokens: int) -> dict:
    name, params = parse_policy(spec)
    view_type = kvpress.policies.get_policy_class(name)
    reads, real_select = [], view_type.select

    def counting(self, ctx):
        indices, valid = real_select(self, ctx)
        held = ctx.layer.key_valid().sum(-1).float()  # [B, Hkv]
        reads.append(float(((valid & ctx.layer.key_valid().gather(-1, indices)).sum(-1) / held).mean()))
        return indices, valid

    view_type.select = counting
    try:
        cache = KVPressCache(model.config)
        with kvpress.patch_model(model, name, **params):
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
    finally:
        view_type.select = real_select
    return dict(view=spec, read_fraction=round(sum(reads) / len(reads), 4), steps=len(reads),
                state_bytes=_state_bytes(cache), cache_bytes=cache.nbytes())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--views", required=True, help="comma list of read-view specs, e.g. quest:budget=410")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    ids = needle_prompt(tok, args.length, seed=1).input_ids
    for spec in args.views.split(","):
        print(json.dumps(measure(model, ids, spec, args.new_tokens)), flush=True)


if __name__ == "__main__":
    main()
