"""Document QA in vLLM: many questions over few documents, with each document compressed once and shared.

The queue: `--documents` documents of `--doc-tokens` tokens of real text (each from its own seed), `--questions`
questions about each, the whole queue arriving at once in a shuffled order (seeded), each answer `--new-tokens`
greedy tokens (end of sequence ignored). The KV memory holds `--kv-documents` uncompressed documents' pages (with
a question and its answer), fewer than the documents, so stock vLLM's prefix cache cannot hold them all.

  stock          vLLM with prefix caching on (its default): a question whose document's pages are still cached
                 (another question of it running, or not yet evicted) skips computing the document
  <policy> shared  kvpress with the policy at the ratio, each request declaring its document as its context
                 (extra_args={"kvpress": {"context_tokens": N}}): the document is compressed once, where it ends,
                 without the question, and later questions are handed its compacted pages

Each config runs in a process of its own, in the order given (`--repeats` runs the whole list again: configs
interleaved). Measured per config, in one run:

  answers/s      answers / wall time from the queue's arrival to the last answer
  hit rate       prompt tokens handed from the prefix cache / prompt tokens (vLLM's num_cached_tokens)
  computed       prompt tokens computed: the arithmetic limit of the speedup on a prefill-bound machine is stock's
                 computed tokens over kvpress's (the questions' decode is the same work in both)
  running        the most requests running at once

    .venv-vllm/bin/python benchmarks/vllm_shared_contexts.py --out docs/results/vllm_shared_contexts
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from vllm_capacity import append_rows, each_in_its_own_process, prompts  # (benchmarks/ is on the path of a script run from it)

PAGE = 128
QUESTIONS = [" Question: what is the first thing this text says about the river? Answer:",
             " Question: which animal appears most often in the text above? Answer:",
             " Question: summarize the second paragraph in one sentence. Answer:",
             " Question: what colour is mentioned last? Answer:",
             " Question: name one place described in the text. Answer:",
             " Question: what happens at the end of the text? Answer:",
             " Question: who is the main character, if any? Answer:",
             " Question: give a title for this text. Answer:"]


def run_config(args, config: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvpress.models import model_path

    folder = str(model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = prompts(tokenizer, args.documents, args.doc_tokens, first_seed=2000)  # real text, a seed each
    questions = [tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS[:args.questions]]
    queue = [(d, q) for d in range(len(docs)) for q in range(len(questions))]
    random.Random(0).shuffle(queue)
    token_bytes = 2 * 30 * 3 * 64 * 4  # SmolLM2 in fp32: K and V of 30 layers x 3 KV heads x 64 channels
    longest = args.doc_tokens + max(map(len, questions)) + args.new_tokens
    kv_bytes = args.kv_documents * -(-longest // PAGE) * PAGE * token_bytes
    settings = config.get("engine")
    llm = LLM(folder, dtype="float32", max_model_len=-(-longest // PAGE) * PAGE + PAGE, kv_cache_memory_bytes=kv_bytes,
              enable_prefix_caching=True, enforce_eager=True,
              additional_config={"kvpress": settings} if settings else {}, seed=0)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    extra = {"extra_args": {"kvpress": {"context_tokens": args.doc_tokens}}} if config.get("shared") else {}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, **extra)
    begin = time.perf_counter()
    for i, (d, q) in enumerate(queue):
        engine.add_request(f"q{i}", TokensPrompt(prompt_token_ids=docs[d] + questions[q]), params)
    running = answers = cached = prompt_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                answers += 1
                cached += out.num_cached_tokens
                prompt_tokens += len(out.prompt_token_ids)
        running = max(running, len(scheduler.running))
    wall = time.perf_counter() - begin
    engine.engine_core.shutdown()
    return dict(config=config["label"], answers=answers, answers_s=round(answers / wall, 3), wall_s=round(wall, 1),
                hit_rate=round(cached / prompt_tokens, 3), computed=prompt_tokens - cached, running=running,
                kv_pages=scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)


def parse_configs(text: str) -> list[dict]:
    """'stock,kvzap:0.75' -> configs; a policy config declares each document as its requests' shared context."""
    out = []
    for item in text.split(","):
        name, _, ratio = item.strip().partition(":")
        if name == "stock":
            out.append({"label": "stock (prefix caching)"})
        else:
            engine = {"policy": name, **({"compression_ratio": float(ratio)} if ratio else {})}
            out.append({"label": f"{name} {ratio} shared", "engine": engine, "shared": True})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| config | answers/s | vs stock | hit rate | prompt tokens computed | limit (stock's computed / "
             "this) | running at once | wall s |", "|---|---|---|---|---|---|---|---|"]
    stock = next((r for r in rows if r["config"].startswith("stock")), None)
    for r in rows:
        if r["config"].startswith("stock"):
            stock = r  # each config against the stock run before it (configs interleaved)
        vs = f"{r['answers_s'] / stock['answers_s']:.2f}x" if stock else ""
        limit = f"{stock['computed'] / r['computed']:.2f}x" if stock and r["computed"] else ""
        lines.append(f"| {r['config']} | {r['answers_s']} | {vs} | {r['hit_rate']:.1%} | {r['computed']} | {limit} | "
                     f"{r['running']} | {r['wall_s']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--configs", default="stock,kvzap:0.75")
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv-documents", type=int, default=8, help="KV memory, in uncompressed documents' pages")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for results.jsonl and summary.md")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config (JSON) and print it
    args = p.parse_args(argv)
    if args.one is not None:
        print("RESULT" + json.dumps(run_config(args, json.loads(args.one))))
        return
    rows = each_in_its_own_process(__file__, parse_configs(args.configs) * args.repeats, args,
                                   ("model", "documents", "questions", "doc_tokens", "new_tokens", "kv_documents"),
                                   lambda config: config["label"])
    print(table(rows))
    if args.out:
        append_rows(Path(args.out), rows)


if __name__ == "__main__":
    main()
