"""Several documents compressed apart and answered as one (kvpress.combine: APE, CacheBlend) against compressing
their concatenation, on the multi-document tasks of evals/multidoc.py (SmolLM2).

    python benchmarks/multi_document.py --policy kvzap --ratio 0.75 --n 20 --out docs/results/multi_document

Per sample: its documents are compressed one by one and saved (a RAG store, done before any question: not timed);
then, timed from the question's arrival to the first answer token:
  concatenation  the documents joined into one context, compressed by the same policy, and asked
  ape            the saved documents loaded, combined by APE (temperature and scale 1), and asked
  cacheblend     the saved documents loaded, combined by CacheBlend (recompute 15%), and asked
Each answer is scored (the fraction of the expected codes it contains), paired with the concatenation's on the same
sample. Rows go to results.jsonl (resumable: finished rows are skipped); the summary prints means, paired
differences with their standard error, and the time-to-first-answer ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvpress  # noqa: E402
from evals import multidoc  # noqa: E402
from kvpress.models import load  # noqa: E402

METHODS = ("concatenation", "ape", "cacheblend")


def run_sample(model, tokenizer, sample, policy, params, new_tokens, folder) -> list[dict]:
    paths = []
    for i, document in enumerate(sample.documents):  # the RAG store: each document compressed once, saved
        paths.append(kvpress.compress(model, tokenizer, document, policy, **params).save(folder / f"doc{i}.kvpress"))
    rows = []
    for method in METHODS:
        start = time.perf_counter()
        if method == "concatenation":
            context = kvpress.compress(model, tokenizer, "\n\n".join(sample.documents), policy, **params)
        else:
            loaded = [kvpress.load(p, model) for p in paths]
            context = kvpress.combine(loaded, method=method)
        ready = time.perf_counter() - start
        answers = context.ask(tokenizer, sample.question, max_new_tokens=new_tokens)
        rows.append(dict(task=sample.task, index=sample.index, method=method, policy=policy, params=params,
                         answer=answers.answers[0], expected=sample.answers, holders=sample.holders,
                         score=multidoc.score(sample, answers.answers[0]), ready_s=ready,
                         first_answer_s=ready + answers.question_s, context_bytes=answers.context_bytes,
                         context_tokens=context.context_tokens))
    return rows


def summary(rows: list[dict]) -> str:
    lines = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        by = {(r["index"], r["method"]): r for r in mine}
        indices = sorted({r["index"] for r in mine if all((r["index"], m) in by for m in METHODS)})
        lines.append(f"{task}, n = {len(indices)}")
        base = [by[i, "concatenation"] for i in indices]
        for method in METHODS:
            got = [by[i, method] for i in indices]
            mean = 100 * statistics.fmean(r["score"] for r in got) if got else float("nan")
            line = f"  {method:<14} score {mean:5.1f}"
            if method != "concatenation" and len(got) > 1:
                diffs = [100 * (a["score"] - b["score"]) for a, b in zip(got, base)]
                se = statistics.stdev(diffs) / math.sqrt(len(diffs))
                ratio = statistics.median(b["first_answer_s"] for b in base) / statistics.median(
                    a["first_answer_s"] for a in got)
                line += (f"  paired {statistics.fmean(diffs):+5.1f} +- {se:.1f}  first answer "
                         f"{statistics.median(a['first_answer_s'] for a in got):.2f} s ({ratio:.1f}x faster)")
            else:
                line += f"  first answer {statistics.median(r['first_answer_s'] for r in got):.2f} s"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="kvzap", help="the documents' policy (default kvzap)")
    p.add_argument("--ratio", type=float, default=0.75, help="compression ratio (default 0.75; none: ignored)")
    p.add_argument("--tasks", default=",".join(multidoc.TASKS), help="comma list of evals/multidoc.py tasks")
    p.add_argument("--n", type=int, default=20, help="samples per task (default 20)")
    p.add_argument("--documents", type=int, default=4, help="documents per sample (default 4)")
    p.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document (default 1024)")
    p.add_argument("--new-tokens", type=int, default=24, help="answer tokens at most (default 24)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", default=None, help="folder for results.jsonl (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load("smollm2")
    params = {} if args.policy == "none" else dict(compression_ratio=args.ratio)
    out = Path(args.out) if args.out else None
    rows = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        results = out / "results.jsonl"
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    done = {(r["task"], r["index"], r["policy"], json.dumps(r["params"])) for r in rows}
    for task in args.tasks.split(","):
        for index in range(args.n):
            if (task, index, args.policy, json.dumps(params)) in done:
                continue
            sample = multidoc.generate(task, tokenizer, index, args.documents, args.doc_tokens)
            with tempfile.TemporaryDirectory() as folder:
                new = run_sample(model, tokenizer, sample, args.policy, params, args.new_tokens, Path(folder))
            rows += new
            if out is not None:
                with results.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in new)
            print(f"{task} #{index}: " + ", ".join(f"{r['method']} {r['score']:.1f} ({r['first_answer_s']:.1f} s)"
                                                   for r in new), flush=True)
    mine = [r for r in rows if r["policy"] == args.policy and r["params"] == params]
    print(f"\nSmolLM2 fp32, {args.documents} documents of {args.doc_tokens} tokens, {args.policy} {params}")
    print(summary(mine))


if __name__ == "__main__":
    main()
