"""One RULER sample's greedy answer under several configs from one shared prefill, with each config's bytes held:
to see which setting of a policy loses a sample the full cache answers (docs/results/shadowkv_8k).

  python benchmarks/answer_probe.py --task niah_single_2 --index 6 --length 8192 \\
      --policies none,shadowkv,shadowkv:rank=40,retrieval:budget=2048
"""

from __future__ import annotations

import argparse

import torch

from evals.engine import answer, configs_for, decode_batches, prefill
from evals.ruler.tasks import generate
from evals.samples import encode
from kvpress.models import load


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", required=True, help="a RULER task, e.g. niah_single_2")
    parser.add_argument("--index", type=int, default=0, help="the sample's index (as in results.jsonl)")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--policies", required=True, help="comma list of policy specs (parameters after colons)")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio for policies that take one")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=torch.float32)
    sample = generate(args.task, tokenizer, args.length, args.index)
    head, tail = encode(tokenizer, sample, sample.questions[0])
    ids = torch.tensor([head + tail])
    configs = configs_for(args.policies.split(","), [args.ratio])
    pre = prefill(model, ids, configs)
    full = None
    for batch, policy in decode_batches(pre, configs, separate=True):
        held = pre.caches[batch[0]].nbytes()
        full = held if batch[0].policy == "none" else full
        tokens, _ = answer(model, pre, batch, policy, None, args.max_new_tokens, {tokenizer.eos_token_id})
        share = "" if full is None else f"  {100 * held / full:.1f}% of the full cache's bytes"
        print(f"{batch[0].policy}: {tokenizer.decode(tokens[0])!r}{share}")
    print("expected:", sample.questions[0].answers)


if __name__ == "__main__":
    main()
