"""Where ZipCache puts a needle: the share of the needle's answer tokens (layer by layer, over KV heads) that its
saliency sends to the low-bit width, against low_ratio (what a choice blind to the needle would send), and the
answer generated. One needle prompt (question in the prompt), greedy decoding.

    python benchmarks/zipcache_needle.py --seed 3                         # probes: last 5% + 5% drawn earlier
    python benchmarks/zipcache_needle.py --seed 3 --params recent_ratio=1  # every prompt row a probe (exact)

Only kvpress's public API is used (patch_model, KVPressCache, KVPressLayer.codes).
"""

from __future__ import annotations

import argparse
import json

import torch

import kvpress
from kvpress.needle import needle_prompt
from evals.engine import parse_policy


def answer_positions(ids: list[int], answer: list[int]) -> list[int]:
    for start in range(len(ids) - len(answer) + 1):
        if ids[start:start + len(answer)] == answer:
            return list(range(start, start + len(answer)))
    raise ValueError("the answer's tokens are not in the prompt")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--params", default="", help="zipcache parameters, e.g. recent_ratio=1:low_ratio=0.4")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    prompt = needle_prompt(tok, args.length, seed=args.seed)
    ids = prompt.input_ids
    answer = tok(" " + prompt.answer, add_special_tokens=False).input_ids
    needle = torch.tensor(answer_positions(ids[0].tolist(), answer))
    _, params = parse_policy("zipcache" + (":" + args.params if args.params else ""))
    cache = kvpress.KVPressCache(model.config)
    with kvpress.patch_model(model, "zipcache", **params), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                             do_sample=False)
    shares = []
    for _, layer in cache.kvpress_layers():
        low = layer.codes[-1].positions[0]  # [Hkv, n]: the low width's positions
        hits = sum(int(torch.isin(needle, low[h]).sum()) for h in range(low.shape[0]))
        shares.append(hits / (len(needle) * low.shape[0]))
    print(json.dumps(dict(answer=prompt.answer, generated=tok.decode(out[0, ids.shape[1]:]), params=params,
                          needle_tokens=len(needle), low_share_mean=round(sum(shares) / len(shares), 3),
                          low_share_per_layer=[round(s, 2) for s in shares])))


if __name__ == "__main__":
    main()
