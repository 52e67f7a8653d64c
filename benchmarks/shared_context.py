"""Many questions over one compressed context: the context shared by every row (cache/prefix.py, Hydragen) against
today's replication (the context copied into every row), in one run, configs interleaved.

    python benchmarks/shared_context.py --length 4096 --questions 16,64 --out docs/results/shared_context

For each question count: `CompressedContext.ask` (shared) and the same generate over a fork whose rows each hold the
context (replicated: what ask did before), alternating `--repeats` times. Reported per config: the bytes the batch's
cache holds at the end (the context's part, and all of it), decode steps per second (the steps after the first
token, all rows at once, timed by a streamer inside generate), and whether every answer equals the shared batch's
and asking each question alone. Beside each speed figure, the arithmetic limit: the bytes a decode step reads
(weights once + the KV it attends over), shared against replicated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvpress
from kvpress.compressed import TokenClock
from kvpress.models import load
from kvpress.needle import filler
from kvpress.questions import left_padded, stop_ids

QUESTIONS = ["Who founded the cooperative?", "What is the mascot called?", "When was the chair elected?",
             "Where is the cooperative?", "How many farmers founded it?", "What animal is the mascot?",
             "Who is the chair?", "In which year was it founded?"]


def document(tokenizer, n_tokens: int) -> str:
    facts = ("The Blue River Cooperative was founded in 1987 by twelve farmers in Millbrook. Its mascot is a heron "
             "named Pip. Its chair, Ana Duarte, was elected in 2021.")
    return " ".join([facts, *filler(tokenizer, n_tokens - len(tokenizer.encode(facts)), seed=3)])


def replicated(compressed, tokenizer, questions, max_new_tokens):
    """What ask did before the shared context: a fork whose rows each hold the context, then generate."""
    model = compressed.model
    ids = [compressed.question_format.ids(tokenizer, q) for q in questions]
    stop = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    x, mask = left_padded(compressed.context_ids, ids, pad)
    cache = compressed.fork()
    cache.batch_repeat_interleave(len(ids))
    clock = TokenClock()
    with kvpress.patch_model(model, compressed.make_policy(tokenizer)), torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, pad_token_id=pad, eos_token_id=sorted(stop), streamer=clock,
                             cache=cache)
    tokens = []
    for row in out[:, x.shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), len(row))
        tokens.append(row[:cut])
    steps = max(len(clock.stamps) - 2, 0)
    return tokens, steps / (clock.stamps[-1] - clock.stamps[1]) if steps else 0.0, cache.nbytes()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="context tokens (default 4096)")
    p.add_argument("--questions", default="16,64", help="question counts (default 16,64)")
    p.add_argument("--new-tokens", type=int, default=32, help="answer tokens at most (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each config, alternated (default 2)")
    p.add_argument("--policy", default="kvzap+kivi", help="policy (default kvzap+kivi at 0.75, 4 bits, residual 32)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", default=None, help="folder for results.json (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load("smollm2")
    params = dict(compression_ratio=0.75, bits=4, residual_length=32) if args.policy == "kvzap+kivi" else \
        dict(compression_ratio=0.75)
    compressed = kvpress.compress(model, tokenizer, document(tokenizer, args.length), args.policy, **params)
    context = compressed.nbytes()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"SmolLM2 fp32, {compressed.context_tokens} context tokens, {args.policy} {params}: context {context / 2**20:.1f}"
          f" MiB ({compressed.nbytes() / compressed.full_cache_nbytes():.1%} of the full cache); weights "
          f"{weights / 2**20:.0f} MiB; {torch.get_num_threads()} threads")
    rows = []
    for n in (int(x) for x in args.questions.split(",")):
        questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (asked {i // len(QUESTIONS) + 1})")
                     for i in range(n)]
        shared_rates, replicated_rates = [], []
        for _ in range(args.repeats):  # interleaved
            answers = compressed.ask(tokenizer, questions, max_new_tokens=args.new_tokens)
            shared_rates.append(answers.decode_steps / answers.decode_s if answers.decode_s else 0.0)
            tokens, rate, replicated_bytes = replicated(compressed, tokenizer, questions, args.new_tokens)
            replicated_rates.append(rate)
        alone = [compressed.ask(tokenizer, q, max_new_tokens=args.new_tokens).token_ids[0] for q in questions[:8]]
        shared, copied = statistics.median(shared_rates), statistics.median(replicated_rates)
        # what one decode step reads: the weights once, and the KV it attends over (the context once when shared)
        read_shared, read_copied = weights + context, weights + n * context
        row = dict(questions=n, context_bytes=context, shared_batch_bytes=answers.batch_bytes,
                   replicated_batch_bytes=replicated_bytes, shared_steps_per_s=shared, replicated_steps_per_s=copied,
                   speedup=shared / copied if copied else None, step_bytes_shared=read_shared,
                   step_bytes_replicated=read_copied, limit=read_copied / read_shared,
                   same_as_alone=answers.token_ids[:8] == alone,
                   same_as_replicated=sum(a == b for a, b in zip(answers.token_ids, tokens)),
                   shared_rates=shared_rates, replicated_rates=replicated_rates)
        rows.append(row)
        print(f"{n} questions: context held {answers.context_bytes / 2**20:.1f} MiB once (replicated: "
              f"{n * context / 2**20:.0f} MiB); the batch's cache at the end {answers.batch_bytes / 2**20:.1f} MiB shared, "
              f"{replicated_bytes / 2**20:.1f} MiB replicated; decode {shared:.2f} vs {copied:.2f} steps/s = "
              f"{row['speedup']:.2f}x (bytes a step reads: {read_copied / read_shared:.2f}x fewer); answers equal "
              f"asking alone: {row['same_as_alone']}; equal to the replicated batch's: {row['same_as_replicated']}/{n}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(dict(length=compressed.context_tokens, policy=args.policy,
                                                          params=params, threads=torch.get_num_threads(),
                                                          rows=rows, time=time.strftime("%Y-%m-%d %H:%M")), indent=1))


if __name__ == "__main__":
    main()
