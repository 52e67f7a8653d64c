"""Why a chunked prefill with eviction loses an early needle at 8K on SmolLM2, and a one-shot prefill does not.

A chunked prefill that evicts after each chunk computes every later chunk over a past with holes. This script
separates that effect from token selection. It runs the plain model (no kvpress) with a 4D attention mask that
expresses chunked eviction exactly: tokens of a later chunk see only what earlier chunks kept, and the answer's
tokens see only what the prompt kept. tests/test_budgets.py checks that kvpress's chunked eviction gives these
same logits. The kept set is random, but the needle sentence, the first 4 tokens and the question are always
kept. So selection cannot be what fails: if the needle is lost, it is because the context was computed with holes.
Then the same kept set is used with

  one-shot                   the whole prompt computed with full attention, eviction only before the answer
  chunked                    each 1024-token chunk (the remainder first, as kvpress chunks) computed over
                             what the earlier chunks kept
  only the last chunk        earlier chunks computed in full; the last chunk (the document's tail and the
                             question) computed over the evicted past

The answer is teacher-forced: the figure is the model's greedy prediction of each answer token. The kvpress
runs (SnapKV, chunked with the question appended to each chunk) are printed first, for reference.

  python benchmarks/chunked_drift.py                      # SmolLM2, 8K, depth 0.1, seed 3 (the test's prompt)
  python benchmarks/chunked_drift.py --length 3000 --evict 0.25,0.75
  python benchmarks/chunked_drift.py --seeds 1,2,3,4,5    # full cache, one-shot and chunked, one prompt per seed
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress.models import load
from kvpress.needle import needle_prompt


def needle_span(tok, prompt) -> tuple[int, int]:
    """Token range of the needle sentence in the prompt (found by decoding prefixes)."""
    ids = prompt.input_ids[0]
    marker = f"passcode is {prompt.answer}"
    lo, hi = 0, ids.shape[0]
    while hi - lo > 1:  # the shortest prefix that contains the needle
        mid = (lo + hi) // 2
        if marker in tok.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid
    return max(0, hi - 16), hi + 2


def masked_answer(model, ids, n_prompt, keep, chunk_starts) -> torch.Tensor:
    """Greedy predictions of the answer tokens (teacher-forced) under chunked eviction written as a 4D mask:
    rows at or after each start in `chunk_starts` see only the kept tokens before it, and answer rows see only
    the kept prompt tokens."""
    total = ids.shape[1]
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    seen = torch.ones(total, dtype=torch.bool)
    seen[:n_prompt] = keep
    for start in chunk_starts:
        allowed[start:, :start] &= seen[:start]
    allowed[n_prompt:, :n_prompt] &= keep
    mask = torch.zeros(1, 1, total, total, dtype=model.dtype).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, logits_to_keep=total - n_prompt + 1).logits[0]
    return logits[:-1].argmax(-1)


def seed_sweep(model, tok, args):
    """One prompt per seed: does the full cache answer it, one-shot SnapKV at 0.75, and chunked SnapKV at 0.75 with
    and without the question appended to each chunk."""
    runs = {"full cache": ("none", {}), "one-shot": ("snapkv", dict(compression_ratio=0.75)),
            "chunked, question appended": ("snapkv", dict(compression_ratio=0.75, prefill_chunk_size=args.chunk,
                                                          question_tokens=40)),
            "chunked": ("snapkv", dict(compression_ratio=0.75, prefill_chunk_size=args.chunk))}
    print("| seed | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    for seed in (int(x) for x in args.seeds.split(",")):
        prompt = needle_prompt(tok, args.length, depth=args.depth, seed=seed)
        found = []
        for policy, params in runs.values():
            with torch.no_grad(), kvpress.patch_model(model, policy, **params):
                out = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                     max_new_tokens=8, do_sample=False)
            answer = tok.decode(out[0, prompt.n_tokens:], skip_special_tokens=True).strip()
            found.append(f"{answer!r} " + ("found" if prompt.answer in answer else "LOST"))
        print(f"| {seed} ({prompt.answer}) | " + " | ".join(found) + " |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--depth", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--evict", default="0.05,0.25,0.75", help="fractions of the prompt evicted at random")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", default=None,
                        help="comma-separated: full cache, one-shot and chunked SnapKV at 0.75 on one prompt per seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    if args.seeds:
        return seed_sweep(model, tok, args)
    prompt = needle_prompt(tok, args.length, depth=args.depth, seed=args.seed)
    n = prompt.n_tokens
    lo, hi = needle_span(tok, prompt)
    print(f"{args.model}, {n} tokens, needle at tokens {lo}-{hi}, answer {prompt.answer}, chunk {args.chunk}")

    def generate(**patch):
        with torch.no_grad(), kvpress.patch_model(model, "snapkv", **patch):
            out = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                 max_new_tokens=8, do_sample=False)
        return tok.decode(out[0, n:], skip_special_tokens=True)

    print("\n| kvpress run (SnapKV) | evicted | answer |\n|---|---|---|")
    for label, patch in (("one-shot", {}), ("chunked, question appended to each chunk",
                                            dict(prefill_chunk_size=args.chunk, question_tokens=40))):
        for ratio in (0.75, 0.05):
            t = time.time()
            answer = generate(compression_ratio=ratio, **patch)
            print(f"| {label} | {ratio} | {answer.strip()!r} {'found' if prompt.answer in answer else 'LOST'} "
                  f"({time.time() - t:.0f} s) |", flush=True)

    answer_ids = tok(" " + prompt.answer + ".", add_special_tokens=False, return_tensors="pt").input_ids
    ids = torch.cat([prompt.input_ids, answer_ids], 1)
    starts = list(range(n - (n - 1) // args.chunk * args.chunk, n, args.chunk))  # kvpress's: chunks end at n
    variants = {"one-shot": [], "chunked": starts, "only the last chunk": starts[-1:]}
    print(f"\n| random eviction, needle + 4 sinks + question kept | evicted | predicted answer (want "
          f"{tok.decode(answer_ids[0])!r}) |\n|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for fraction in (float(x) for x in args.evict.split(",")):
        keep = torch.rand(n, generator=g) >= fraction
        keep[lo:hi] = True
        keep[:4] = True
        keep[-40:] = True
        for name, starts in variants.items():
            predicted = tok.decode(masked_answer(model, ids, n, keep, starts))
            verdict = "found" if prompt.answer in predicted else "LOST"
            print(f"| {name} | {fraction} | {predicted!r} {verdict} |", flush=True)


if __name__ == "__main__":
    main()
