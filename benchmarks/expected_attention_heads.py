"""Why expected_attention loses needles on SmolLM2: which (layer, KV head) pairs drop the needle, and which
layers' choices the answer depends on.

One RULER-style sample (question in the prompt), each policy at one ratio. Prints, for every layer where some KV
head keeps under half of the needle's tokens, each head's kept needle tokens ('x' kept, '.' evicted), the
greedy answer, then the answer when expected_attention's kept sets are replaced by the reference policy's in a
group of layers (the prefill is the same for every policy: each layer evicts after its own attention, so the
layers of two caches can be mixed).

    python benchmarks/expected_attention_heads.py                     # niah_single_1 #0, ratio 0.5 (~4 min)
    python benchmarks/expected_attention_heads.py --policies expected_attention,expected_attention:use_covariance=False,keydiff,snapkv
"""

from __future__ import annotations

import argparse

import torch

import kvpress
from evals.engine import parse_policy
from evals.ruler.tasks import generate as ruler_sample
from evals.samples import encode
from kvpress import KVPressCache, models


def needle_span(tokenizer, ids: list[int], answer: str) -> list[int]:
    """Token indices covering the answer's characters in the decoded prompt (plus one token either side)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + len(piece))
    at = "".join(pieces).find(answer)
    inside = [i for i in range(len(ids)) if starts[i] < at + len(answer) and starts[i + 1] > at]
    return list(range(inside[0] - 1, inside[-1] + 2))


def compressed(model, ids: torch.Tensor, spec: str, ratio: float) -> KVPressCache:
    """The prompt minus its last token, prefilled under `spec`: generate() then feeds that token."""
    name, params = parse_policy(spec)
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, policy=name, compression_ratio=ratio, **params), torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache)
    return cache


def answer(model, tokenizer, ids: torch.Tensor, cache: KVPressCache) -> str:
    with kvpress.patch_model(model, policy="none"):
        out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=10, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--policies", default="expected_attention,snapkv")
    p.add_argument("--reference", default="snapkv", help="whose kept sets are swapped in, layer group by group")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = models.load("smollm2", dtype=torch.bfloat16)
    sample = ruler_sample(args.task, tokenizer, 4096, args.index)
    question = sample.questions[0]
    head, tail = encode(tokenizer, sample, question)
    ids = torch.tensor([head + tail])
    needle = needle_span(tokenizer, head + tail, question.answers[0])
    print(f"{args.task} #{args.index}: {ids.shape[1]} tokens, answer {question.answers[0]!r}, needle tokens "
          f"{needle[0]}-{needle[-1]} {[tokenizer.decode([ids[0, i]]) for i in needle]}, ratio {args.ratio}")
    caches = {}
    for spec in args.policies.split(","):
        cache = caches[spec] = compressed(model, ids, spec, args.ratio)
        print(f"\n{spec}: answers {answer(model, tokenizer, ids, cache.fork())!r}")
        for index, layer in enumerate(cache.layers):
            positions = layer.key_positions()[0]
            kept = [[bool((positions[h] == at).any()) for at in needle] for h in range(positions.shape[0])]
            if any(sum(head_kept) < len(needle) / 2 for head_kept in kept):
                print(f"  layer {index:2d}  " + "  ".join("".join("x" if k else "." for k in h) for h in kept))
    if args.reference not in caches:
        caches[args.reference] = compressed(model, ids, args.reference, args.ratio)
    subject = args.policies.split(",")[0]
    n_layers = len(caches[subject].layers)
    print(f"\n{subject} with {args.reference}'s kept sets in some layers:")
    groups = [(first, min(n_layers, first + 5)) for first in range(0, n_layers, 5)] + [(0, n_layers)]
    for first, end in groups:
        mixed = caches[subject].fork()
        for index in range(first, end):
            mixed.layers[index] = caches[args.reference].layers[index].fork()
        print(f"  layers {first:2d}-{end - 1:2d}: {answer(model, tokenizer, ids, mixed)!r}")


if __name__ == "__main__":
    main()
