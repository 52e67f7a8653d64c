"""`make demo`: what kvpress does best, measured in this run on SmolLM2 (CPU).

One long document (filler text with four facts at different depths) is compressed once, query-agnostically, with
the best configuration measured on this model for about a tenth of the full cache's bytes (kvzap + 4-bit KIVI: half
of the tokens removed, the rest stored in 4 bits), and beside it kept whole (the full cache). Then both are asked
four questions the compressor never saw, in one batch: the answers, the bytes each context holds (from its storage
tensors), the prefill (compression) time, the questions' forward and the decode speed. Last, the compressed context
is saved to a file, loaded back and asked again: the same answers."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import kvpress
from kvpress.models import context_of, load
from kvpress.cli import ShowDefaults
from kvpress.needle import filler

FACTS = [  # (sentence, question, what a correct answer contains)
    ("The passcode of the blue door is 48213.", "What is the passcode of the blue door?", "48213"),
    ("The lighthouse keeper is called Orla Quint.", "What is the lighthouse keeper called?", "Orla Quint"),
    ("The ferry to Kessar leaves at 7:40 every morning.", "When does the ferry to Kessar leave?", "7:40"),
    ("The treasury of the village holds 316 gold coins.", "How many gold coins does the treasury hold?", "316"),
]
DEPTHS = [0.15, 0.4, 0.65, 0.9]
QUESTION_ROOM = 64  # tokens a question and the chat template around it take after the document
BEST = dict(policy="kvzap+kivi", compression_ratio=0.5, bits=4, residual_length=32)


def document(tokenizer, n_tokens: int, seed: int = 1) -> str:
    """Filler sentences up to about `n_tokens` tokens, with the facts inserted at DEPTHS."""
    sentences = filler(tokenizer, n_tokens, seed)
    for depth, (fact, _, _) in sorted(zip(DEPTHS, FACTS), reverse=True):
        sentences.insert(round(depth * len(sentences)), fact)
    return " ".join(sentences)


def row(label: str, compressed, answers, full_bytes: int) -> str:
    right = sum(expected.lower() in a.lower() for a, (_, _, expected) in zip(answers.answers, FACTS))
    steps_per_s = answers.decode_steps / answers.decode_s if answers.decode_s else float("nan")
    return (f"{label:<34} {compressed.nbytes() / 2**20:>9.2f} MiB {compressed.nbytes() / full_bytes:>7.1%} "
            f"{compressed.kept_fraction():>6.1%} {compressed.compress_s:>9.1f} {answers.question_s:>10.2f} "
            f"{steps_per_s:>9.1f} {right:>4}/{len(FACTS)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress demo", description=__doc__, formatter_class=ShowDefaults)
    parser.add_argument("--tokens", type=int, default=6000, help="document length in tokens (default 6000)")
    parser.add_argument("--new-tokens", type=int, default=24, help="answer length limit in tokens (default 24)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("tokens", "new_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}; allowed values: an int >= 1")
    context = context_of("smollm2")  # (its config.json: before the model loads)
    if context is not None and args.tokens + args.new_tokens + QUESTION_ROOM > context:
        parser.error(f"--tokens={args.tokens} --new-tokens={args.new_tokens}: with the questions that is more than "
                     f"SmolLM2 reads ({context} tokens); allowed values: --tokens + --new-tokens <= "
                     f"{context - QUESTION_ROOM}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load("smollm2")
    text = document(tokenizer, args.tokens)
    questions = [q for _, q, _ in FACTS]
    print(f"SmolLM2-135M-Instruct, fp32, CPU ({torch.get_num_threads()} threads). A {args.tokens:,}-token document "
          f"with four facts at depths {', '.join(f'{d:.0%}' for d in DEPTHS)}; the questions come after compression."
          f"\n")

    progress = not args.no_progress
    print("prefilling the document twice (kept whole, and compressed), then asking both: minutes on 2 cores",
          flush=True)
    full = kvpress.compress(model, tokenizer, text, "none", progress=progress)
    best = kvpress.compress(model, tokenizer, text, progress=progress, **BEST)
    full_bytes = full.nbytes()
    runs = [("full cache", full), ("kvzap+kivi: 50% evicted, 4-bit", best)]
    results = [(label, c, c.ask(tokenizer, questions, max_new_tokens=args.new_tokens, progress=progress))
               for label, c in runs]

    print(f"{'context':<34} {'KV held':>13} {'bytes':>7} {'tokens':>6} {'prefill s':>9} {'question s':>10} "
          f"{'decode/s':>9} {'right':>6}")
    for label, compressed, answers in results:
        print(row(label, compressed, answers, full_bytes))
    print("\nKV held: every tensor the context's cache stores (keys, values or their codes, kept positions). bytes: "
          "of the full cache's. tokens: context tokens kept. prefill s: the document's forward and its compression. "
          "question s: the four questions' forward (one batch, left-padded). decode/s: batch steps per second "
          "(one token for each question per step). right: answers holding the expected text; SmolLM2-135M is a small "
          "model and misses some with the full cache too, so compare each compressed answer with the full cache's.\n")
    for i, question in enumerate(questions):
        print(f"Q{i + 1}. {question}  (expected: {FACTS[i][2]})")
        for label, _, answers in results:
            print(f"    {label:<32} {answers.answers[i]!r}")

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = best.save(Path(folder) / "document.kvpress")
        saved_s, size = time.perf_counter() - start, path.stat().st_size
        start = time.perf_counter()
        later = kvpress.load(path, model)
        loaded_s = time.perf_counter() - start
        again = later.ask(tokenizer, questions, max_new_tokens=args.new_tokens, progress=progress)
    same = again.answers == results[1][2].answers
    print(f"\nSaved the compressed context: {size / 2**20:.2f} MiB in {saved_s:.2f} s; loaded in {loaded_s:.2f} s "
          f"(no prefill: {best.compress_s:.1f} s saved). Asked again after loading: "
          f"{'the same answers' if same else 'DIFFERENT answers: ' + repr(again.answers)}.")


if __name__ == "__main__":
    main()
