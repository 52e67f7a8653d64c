"""Captured decode steps on this machine: a real model's decode steps run eagerly on a KVPressCache, and compiled
(torch.compile fullgraph, dynamic=False) on one with a capture_reserve, side by side in one run.

Per config: greedy tokens of both (identical or where they first differ), ms per decode step (median, after the
first step, which compiles), the compile seconds, and how many graphs the compiled steps used (1 + one per event:
a low-bit flush; a cut or a page crossing is not one). On CPU there is no CUDA graph to replay, so this measures
what compiling the step (inductor: fused CPU kernels, no Python per layer) does to a step here; the GPU figures
are gpu_suite.py's section 7.

    python benchmarks/captured_decode.py --context 2048 --new-tokens 32 --configs none,snapkv+kivi,quest,h2o
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo as dynamo

import kvpress
from kvpress import KVPressCache
from kvpress.models import load

CONFIGS = {
    "none": ("none", {}),
    "snapkv": ("snapkv", dict(compression_ratio=0.5)),
    "snapkv+kivi": ("snapkv+kivi", dict(compression_ratio=0.5, bits=4, group_size=32, residual_length=64)),
    "quest": ("quest", dict(budget=256)),
    "h2o": ("h2o", dict(compression_ratio=0.5, slack=16)),
}


class Graphs:
    def __init__(self, backend):
        self.count, self.backend = 0, backend

    def __call__(self, gm, example_inputs):
        self.count += 1
        if self.backend == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


def decode(model, cache, ids, new_tokens, step) -> tuple[list[int], list[float]]:
    """Prefill `ids`, then `new_tokens` greedy steps through `step`; (tokens, seconds per step)."""
    token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    tokens, seconds = [], []
    for i in range(new_tokens):
        position = torch.tensor([[ids.shape[1] + i]])
        start = time.perf_counter()
        token = step(token, cache=cache, position_ids=position).logits[:, -1:].argmax(-1)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(token))
    return tokens, seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model kvpress.models converts (smollm2, gemma3)")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per config")
    p.add_argument("--configs", default="none,snapkv+kivi,quest,h2o", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"],
                   help="torch.compile backend (eager: traced, not compiled)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load(args.model)
    ids = torch.randint(100, 10000, (1, args.context), generator=torch.Generator().manual_seed(0))
    print(f"{args.model}, fp32, CPU ({args.threads} threads), {args.context}-token prompt, {args.new_tokens} greedy "
          f"steps; backend {args.backend}, fullgraph, dynamic=False\n")
    print(f"{'config':14} {'eager ms':>9} {'captured ms':>12} {'speedup':>8} {'compile s':>10} {'graphs':>7}  tokens")
    for name in args.configs.split(","):
        policy, params = CONFIGS[name]
        with kvpress.patch_model(model, policy, **params), torch.no_grad():
            plain, eager_s = decode(model, KVPressCache(model.config), ids, args.new_tokens, model)
            dynamo.reset()
            graphs = Graphs(args.backend)
            step = torch.compile(model, fullgraph=True, dynamic=False, backend=graphs)
            cache = KVPressCache(model.config, capture_reserve=args.new_tokens + 1)
            captured, captured_s = decode(model, cache, ids, args.new_tokens, step)
        same = "identical" if plain == captured else \
            f"differ from step {next(i for i, (a, b) in enumerate(zip(plain, captured)) if a != b)}"
        e, c = statistics.median(eager_s[1:]) * 1e3, statistics.median(captured_s[1:]) * 1e3
        print(f"{name:14} {e:9.1f} {c:12.1f} {e / c:7.2f}x {captured_s[0]:10.1f} {graphs.count:7d}  {same}")
        dynamo.reset()


if __name__ == "__main__":
    main()
