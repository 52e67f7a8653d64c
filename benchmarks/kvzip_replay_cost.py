"""What KVzip's prefill costs against the plain prefill, and how much of it is the replay itself.

KVzip replays the prompt over the full prefilled cache (about one more prefill's worth of tokens, each reading the
whole cache plus its own chunk) and then scores the chunk's slots with a restricted softmax. The third figure
runs the same replay forwards with the scoring replaced by zeros: the floor any scoring code can reach.

  python benchmarks/kvzip_replay_cost.py --lengths 4096,8192      # SmolLM2, fp32, 2 threads
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress import models
from kvpress.policies import kvzip


def timed_prefill(model, ids, policy, **params) -> float:
    cache = kvpress.KVPressCache(model.config)
    start = time.perf_counter()
    with torch.no_grad(), kvpress.patch_model(model, policy=policy, **params):
        model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = models.load(args.model, dtype=torch.float32)
    scores = kvzip.KVzip._chunk_scores
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(0))
        timed_prefill(model, ids, "none")  # warm-up
        plain = min(timed_prefill(model, ids, "none") for _ in range(2))
        full = timed_prefill(model, ids, "kvzip", compression_ratio=args.ratio)
        # the counterfactual: replay forwards as they are, scores all zero (what is left with free scoring)
        kvzip.KVzip._chunk_scores = lambda self, ctx, chunk, seen: torch.zeros(ctx.layer.key_valid().shape)
        try:
            floor = timed_prefill(model, ids, "kvzip", compression_ratio=args.ratio)
        finally:
            kvzip.KVzip._chunk_scores = scores
        print(f"{length} tokens: plain prefill {plain:.1f} s; kvzip {full:.1f} s ({full / plain:.2f}x); prefill + "
              f"replay forwards, scoring free {floor:.1f} s ({floor / plain:.2f}x); scoring {full - floor:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
