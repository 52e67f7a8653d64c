"""Self-speculative decoding on SmolLM2: acceptance, tokens per verify step, and speed against plain decoding
with the same cache, per draft kind and gamma, at several context lengths (CPU here; GPU if present).

Prompt: a document of the demo's haystack sentences, then a request to retell it (a long answer). Both runs
stop at EOS the same way (no forced length), and tokens/s count the tokens actually generated.

    python benchmarks/speculative.py [--contexts 2048,4096] [--gammas 3] [--drafts quest,retrieval,...]
                                     [--budget-frac 0.1] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress.models import load
from kvpress.needle import haystack_sentences
from kvpress.speculative import DRAFTS


def retell_prompt(tok, n_tokens: int, seed: int = 3):
    request = "\n\nRetell the document above in your own words, in detail, sentence by sentence."
    sentences, text = haystack_sentences(seed), ""
    while True:
        candidate = text + " " + next(sentences)
        prompt = tok.apply_chat_template([{"role": "user", "content": candidate + request}],
                                         add_generation_prompt=True, tokenize=False)
        if len(tok(prompt, add_special_tokens=False).input_ids) > n_tokens:
            break
        text = candidate
    prompt = tok.apply_chat_template([{"role": "user", "content": text + request}], add_generation_prompt=True,
                                     tokenize=False)
    return tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,4096")
    parser.add_argument("--gammas", default="3")
    parser.add_argument("--drafts", default=",".join(sorted(DRAFTS)))
    parser.add_argument("--budget-frac", type=float, default=0.1, help="draft budget as a fraction of the context")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model, tok = load("smollm2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    print(f"SmolLM2-135M-Instruct fp32 on {device} ({torch.get_num_threads()} threads) | greedy | "
          f"draft budget {args.budget_frac:.0%} of the context | {args.new_tokens} new tokens")
    print(f"{'context':>7} {'draft':<14} {'gamma':>5} {'accept/draft':>12} {'tokens/verify':>13} "
          f"{'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'identical':>9}")
    for n in [int(x) for x in args.contexts.split(",")]:
        ids = retell_prompt(tok, n).to(device)
        budget = max(16, int(args.budget_frac * ids.shape[1]))
        for draft in args.drafts.split(","):
            # quant4's target is the 8-bit-KV model (its losslessness reference); the others read the full cache
            target = ("kivi", dict(bits=8)) if draft == "quant4" else ("none", {})
            with kvpress.patch_model(model, target[0], **target[1]):
                start = time.perf_counter()
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                     do_sample=False)
                plain_s = time.perf_counter() - start
                n_new = ref.shape[1] - ids.shape[1]
                for gamma in [int(g) for g in args.gammas.split(",")]:
                    start = time.perf_counter()
                    out, stats = kvpress.speculative_generate(model, ids, draft=draft, gamma=gamma,
                                                              max_new_tokens=args.new_tokens,
                                                              draft_budget=None if draft == "quant4" else budget,
                                                              eos_token_id=tok.eos_token_id,
                                                              pad_token_id=tok.pad_token_id, return_stats=True)
                    spec_s = time.perf_counter() - start
                    print(f"{ids.shape[1]:>7} {draft:<14} {gamma:>5} {stats.acceptance_rate:>12.1%} "
                          f"{stats.tokens_per_round:>13.2f} {n_new / plain_s:>11.2f} "
                          f"{n_new / spec_s:>10.2f} {plain_s / spec_s:>6.2f}x "
                          f"{str(out.tolist() == ref.tolist()):>9}", flush=True)
    print("\ntok/s include the prefill (same for both). accept/draft: accepted drafted tokens / drafted tokens;"
          " tokens/verify: tokens emitted per verification forward. quant4: target = 8-bit KIVI cache.")


if __name__ == "__main__":
    main()
