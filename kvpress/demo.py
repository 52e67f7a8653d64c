"""`make demo`: SmolLM2 on a ~6K-token needle-in-a-haystack prompt, full cache vs three policies at 75%
compression. Every figure is measured in this run: the answer, KV bytes held right after prefill (from the
storage tensors), and decode speed (tokens after the first, timed by a streamer inside `generate`)."""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress.models import load
from kvpress.needle import ANSWER_PREFIX, needle_prompt


class TokenClock:
    """A generate() streamer that timestamps each emitted token (the first put() is the prompt)."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def run(model, tokenizer, prompt, policy, new_tokens, **params):
    clock = TokenClock()
    with kvpress.patch_model(model, policy, **params):
        start = time.perf_counter()
        out = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    stats = kvpress.last_cache_stats(model)
    answer = tokenizer.decode(out[0, prompt.n_tokens:], skip_special_tokens=True).strip()
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: prompt; [1]: first token (after prefill)
    return dict(
        answer=answer, correct=prompt.answer in answer, prefill_bytes=stats["prefill_bytes"],
        prefill_s=first - start, decode_tps=(len(clock.stamps) - 2) / (last - first),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=6000, help="prompt length in tokens")
    parser.add_argument("--ratio", type=float, default=0.75, help="compression ratio (fraction removed)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--depth", type=float, default=0.5, help="needle depth in the document (0..1)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load("smollm2")
    prompt = needle_prompt(tokenizer, args.tokens, depth=args.depth, seed=1)
    print(f"SmolLM2-135M-Instruct (fp32, CPU, {torch.get_num_threads()} threads) | prompt {prompt.n_tokens} tokens, "
          f"needle at depth {args.depth:.2f}, expected answer {prompt.answer} | {args.new_tokens} new tokens\n")
    configs = [("full cache", "none", {}),
               (f"snapkv {args.ratio:.0%}", "snapkv", dict(compression_ratio=args.ratio)),
               (f"h2o {args.ratio:.0%}", "h2o", dict(compression_ratio=args.ratio)),
               (f"streaming_llm {args.ratio:.0%}", "streaming_llm", dict(compression_ratio=args.ratio))]
    header = f"{'policy':<20} {'answer':<34} {'correct':<8} {'KV bytes after prefill':>23} {'ratio':>6} " \
             f"{'prefill s':>9} {'decode tok/s':>12}"
    print(header)
    print("-" * len(header))
    full_bytes = None
    for label, policy, params in configs:
        r = run(model, tokenizer, prompt, policy, args.new_tokens, **params)
        full_bytes = full_bytes or r["prefill_bytes"]
        shown = (ANSWER_PREFIX + " " + r["answer"]).replace("\n", " ")
        shown = shown if len(shown) <= 34 else shown[:31] + "..."
        print(f"{label:<20} {shown:<34} {'yes' if r['correct'] else 'no':<8} {r['prefill_bytes']:>23,} "
              f"{r['prefill_bytes'] / full_bytes:>6.3f} {r['prefill_s']:>9.1f} {r['decode_tps']:>12.1f}", flush=True)
    print("\nKV bytes: every tensor the cache holds (keys, values, and for compressed layers the kept tokens'"
          " original positions). ratio: against the full cache.")


if __name__ == "__main__":
    main()
