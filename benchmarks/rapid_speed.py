"""RAPID against plain greedy decoding on CPU: needle prompts cut into the document (context) and the question; the
target reads both, the draft the chunks BM25 finds for the question plus the question. Prints per prompt: whether
RAPID's tokens equal plain greedy's (they must), whether the answer holds the needle, the acceptance rate, tokens per
round, and decode tokens per second of each (prefill excluded: RAPID's second prefill, the draft's, is reported on
its own).

    python benchmarks/rapid_speed.py --lengths 4096,8192 --prompts 3 --new-tokens 32 --gamma 4

Only kvpress's public API is used; the model runs unpatched, as rapid_generate requires.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

import kvpress
from kvpress.needle import needle_prompt


def split(tok, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(document ids [1, n], question ids [1, m], the question's own words' ids) of a needle prompt: cut before its
    "QUESTION:" line; the question's words end before the chat template's end-of-turn."""
    text = tok.decode(ids[0])
    cut = text.index("\n\nQUESTION:")
    encode = lambda s: tok(s, return_tensors="pt", add_special_tokens=False).input_ids  # noqa: E731
    words = text[cut:].split("QUESTION:")[1].split("<|im_end|>")[0]
    return encode(text[:cut]), encode(text[cut:]), encode(words)


@torch.no_grad()
def plain(model, prompt: torch.Tensor, new: int) -> tuple[list[int], float, float]:
    """Greedy tokens, prefill seconds, decode seconds (transformers' own cache, one token per forward)."""
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
    prefill = time.perf_counter() - start
    out = [int(token)]
    for _ in range(new - 1):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        out.append(int(token))
    return out, prefill, time.perf_counter() - start - prefill


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvpress.models import load

    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    for length in map(int, args.lengths.split(",")):
        for seed in range(args.prompts):
            needle = needle_prompt(tok, length, depth=(seed + 0.5) / args.prompts, seed=seed)
            context, question, words = split(tok, needle.input_ids)
            prompt = torch.cat([context, question], 1)
            reference, prefill_s, plain_s = plain(model, prompt, args.new_tokens)
            out, stats = kvpress.speculative.rapid_generate(
                model, context, question, chunk_size=args.chunk_size, gamma=args.gamma,
                max_new_tokens=args.new_tokens, eos_token_id=[], query_ids=words, return_stats=True)
            tokens = out[0, prompt.shape[1]:].tolist()
            decode_s = stats.total_s - stats.prefill_s
            row = dict(length=prompt.shape[1], seed=seed, same_as_plain=tokens == reference,
                       needle_found=needle.answer in tok.decode(tokens), acceptance=round(stats.acceptance_rate, 3),
                       tokens_per_round=round(stats.tokens_per_round, 2), gamma=args.gamma,
                       draft_tokens=max(args.chunk_size, context.shape[1] // 10),
                       plain_decode_tok_s=round((args.new_tokens - 1) / plain_s, 2),
                       rapid_decode_tok_s=round((stats.emitted - 1) / decode_s, 2),
                       speedup=round(plain_s / decode_s * (stats.emitted - 1) / (args.new_tokens - 1), 2),
                       target_prefill_s=round(prefill_s, 2), rapid_prefill_s=round(stats.prefill_s, 2),
                       threads=args.threads, dtype=args.dtype)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
