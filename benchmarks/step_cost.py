"""What one forward over a cached context costs on SmolLM2, by context length and number of new tokens: the cost
of a decode step (1 token), a draft step (a short context: the floor every step pays for the weights) and a
speculative verification (gamma + 1 tokens), and of the crop that rolls a rejected draft back.

    python benchmarks/step_cost.py --contexts 256,1024,4096,16384 --rows 1,4
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress.integrations.hf import with_cache
from kvpress.models import load


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,1024,4096,16384", help="cached tokens before the forward")
    parser.add_argument("--rows", default="1,4", help="new tokens per forward")
    parser.add_argument("--repeats", type=int, default=5, help="forwards per cell (the fastest is shown)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load("smollm2")
    print(f"SmolLM2-135M-Instruct fp32, {torch.get_num_threads()} threads, policy none (the full cache)")
    print("cached tokens | new tokens | forward ms (fastest) | median ms | crop ms")
    for n in [int(x) for x in args.contexts.split(",")]:
        ids = torch.randint(100, 20000, (1, n))
        cache = kvpress.KVPressCache(model.config)
        with kvpress.patch_model(model, "none", prefill_chunk_size=4096), torch.no_grad():
            model(**with_cache(model, cache, input_ids=ids))
            for q in [int(x) for x in args.rows.split(",")]:
                fork = cache.fork()
                times, crops = [], []
                for _ in range(args.repeats + 1):  # the first forward grows the fork's own buffer
                    seen = fork.get_seq_length()
                    new = torch.randint(100, 20000, (1, q))
                    start = time.perf_counter()
                    mask = torch.ones(1, seen + q, dtype=torch.long)
                    model(**with_cache(model, fork, input_ids=new, attention_mask=mask,
                                       position_ids=torch.arange(seen, seen + q)[None]))
                    times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    fork.crop(-q)
                    crops.append(time.perf_counter() - start)
                times, crops = sorted(times[1:]), sorted(crops[1:])
                print(f"{n} | {q} | {1000 * times[0]:.1f} | {1000 * times[len(times) // 2]:.1f} | "
                      f"{1000 * crops[len(crops) // 2]:.2f}", flush=True)


if __name__ == "__main__":
    main()
