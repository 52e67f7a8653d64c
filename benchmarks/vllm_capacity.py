"""Requests served at once, and generated tokens per second, by vLLM with and without kvpress, at a fixed KV memory.

Each config runs in a process of its own (an engine and its worker in that process) over the same queue of
requests: `--requests` prompts of `--prompt-tokens` tokens of real text (different for every request), each
generating `--new-tokens` greedy tokens (end of sequence ignored). The KV memory holds `--kv-requests` uncompressed
requests' pages (prompt + new tokens), so that one uncompressed prompt's prefill (its whole prompt's pages, which
vLLM holds before kvpress frees any) is a small part of it. Measured per config, in one run:

  running      the most requests running at once (vLLM's running queue, after each engine step); mean: over the
               steps; preempted: requests preempted at least once (their pages taken back, recomputed later)
  tok/s        generated tokens / wall time from the first request's arrival to the last one's end (prompts
               included: they are most of the work)
  prompt / decode steps s   the wall time of steps that computed prompt tokens (decodes ride along) and of
               steps that only decoded: kvpress leaves the first alone (the same prompts to compute)
  pages        pages a request holds once its prompt is computed and compacted (peak: the most any request holds
               while decoding)
  vs stock     each figure over stock vLLM's (no kvpress settings) in the same run

    .venv-vllm/bin/python benchmarks/vllm_capacity.py --out docs/results/vllm_capacity

Long generations (decode-time eviction: a page back every 128 generated tokens, at a fixed memory per request):

    .venv-vllm/bin/python benchmarks/vllm_capacity.py --requests 48 --prompt-tokens 512 --new-tokens 1024 \
        --kv-requests 8 --configs stock,streaming_llm:budget=256/slack=127,stock,tova:budget=256/slack=127 \
        --out docs/results/vllm_long_generations
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PAGE = 128


def prompts(tokenizer, n: int, length: int, first_seed: int = 1000) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens of kvpress's haystack text, each from its own seed."""
    from kvpress.needle import haystack_sentences

    out = []
    for seed in range(first_seed, first_seed + n):
        sentences, ids = haystack_sentences(seed), []
        while len(ids) < length:
            ids += tokenizer(" ".join(next(sentences) for _ in range(64)), add_special_tokens=False).input_ids
        out.append(ids[:length])
    return out


def run_config(args, settings: dict | None) -> dict:
    """One engine, the whole queue: what this config achieved (runs in its own process)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvpress.models import model_path
    from kvpress.progress import task

    folder = str(model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    queue = prompts(tokenizer, args.requests, args.prompt_tokens)
    token_bytes = 2 * 30 * 3 * 64 * 4  # SmolLM2 in fp32: K and V of 30 layers x 3 KV heads x 64 channels
    pages_per_request = -(-(args.prompt_tokens + args.new_tokens) // PAGE)
    kv_bytes = args.kv_requests * pages_per_request * PAGE * token_bytes
    start = time.perf_counter()
    llm = LLM(folder, dtype="float32", max_model_len=args.prompt_tokens + args.new_tokens + PAGE,
              kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False, enforce_eager=args.eager,
              additional_config={"kvpress": settings} if settings else {}, seed=0)
    started = time.perf_counter() - start
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    per_request = {"extra_args": {"kvpress": json.loads(args.request_settings)}} if settings and \
        args.request_settings else {}  # (a stock engine's requests carry none)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, **per_request)
    begin = time.perf_counter()
    for i, ids in enumerate(queue):
        engine.add_request(f"q{i}", TokensPrompt(prompt_token_ids=ids), params)
    running, steps, generated, pages, peak, running_sum, preempted = 0, 0, 0, [], 0, 0, set()
    prompt_steps_s = decode_steps_s = 0.0
    with task(f"vllm {label(settings)}", total=len(queue), unit="request") as finished:
        while engine.has_unfinished_requests():
            prompts_left = _prompt_tokens_left(scheduler)
            tick = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
                    finished.advance(note=f"{len(scheduler.running)} running")
            took = time.perf_counter() - tick
            if _prompt_tokens_left(scheduler) < prompts_left:  # the step computed prompt tokens (and decoded others)
                prompt_steps_s += took
            else:
                decode_steps_s += took
            steps += 1
            running = max(running, len(scheduler.running))
            running_sum += len(scheduler.running)
            preempted |= {r.request_id for r in scheduler.requests.values() if r.num_preemptions}
            manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
            for request in scheduler.running:  # pages held right after the prompt was computed and compacted
                held = sum(not b.is_null for b in manager.req_to_blocks[request.request_id])
                if request.num_output_tokens == 2 and len(pages) < args.requests:
                    pages.append(held)
                if request.num_output_tokens > 1:  # the most a request holds while decoding
                    peak = max(peak, held)
    wall = time.perf_counter() - begin
    return dict(config=label(settings) + (f" requests {args.request_settings}" if per_request else ""),
                running=running, mean_running=round(running_sum / max(steps, 1), 1),
                preempted=len(preempted), tok_s=round(generated / wall, 2), wall_s=round(wall, 1),
                prompt_steps_s=round(prompt_steps_s, 1), decode_steps_s=round(decode_steps_s, 1),
                steps=steps, generated=generated, pages=round(sum(pages) / max(len(pages), 1), 2), peak_pages=peak,
                kv_pages=scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1, engine_start_s=round(started, 1),
                eager=args.eager, multiprocessing=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"))


def _prompt_tokens_left(scheduler) -> int:
    """Prompt tokens not computed yet (every request was queued at the start; finished ones had none left)."""
    return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.requests.values())


def label(settings: dict | None) -> str:
    if not settings:
        return "stock"
    rest = {k: v for k, v in settings.items() if k != "policy"}
    return settings["policy"] + ("" if not rest else " " + " ".join(f"{k}={v}" for k, v in rest.items()))


def parse_configs(text: str) -> list[dict | None]:
    """'stock,none,snapkv:0.75,streaming_llm:budget=256/slack=127' -> engine settings (None: no kvpress): a
    policy, then its compression ratio, or its parameters as key=value pairs separated by '/'."""
    out = []
    for item in text.split(","):
        name, _, rest = item.strip().partition(":")
        if name == "stock":
            out.append(None)
        elif "=" in rest:
            params = dict(pair.split("=", 1) for pair in rest.split("/"))
            out.append({"policy": name, **{k: json.loads(v) for k, v in params.items()}})
        else:
            out.append({"policy": name, **({"compression_ratio": float(rest)} if rest else {})})
    return out


def table(rows: list[dict]) -> str:
    stock = next((r for r in rows if r["config"] == "stock"), None)  # then each against the stock run before it
    lines = ["| config | running at once (mean) | vs stock | preempted | generated tok/s | vs stock | pages per "
             "request (peak) | wall s | prompt steps s | decode-only steps s |", "|---" * 10 + "|"]
    for r in rows:
        if r["config"] == "stock":
            stock = r
        at_once = "mean_running" if "mean_running" in r and stock and "mean_running" in stock else "running"
        vs_running = f"{r[at_once] / stock[at_once]:.2f}x" if stock and stock[at_once] else ""
        vs_speed = f"{r['tok_s'] / stock['tok_s']:.2f}x" if stock and stock["tok_s"] else ""
        lines.append(f"| {r['config']} | {r['running']} ({r.get('mean_running', '')}) | {vs_running} | "
                     f"{r.get('preempted', '')} | {r['tok_s']} | {vs_speed} | {r['pages']} "
                     f"({r.get('peak_pages', '')}) | {r['wall_s']} | {r['prompt_steps_s']} | {r['decode_steps_s']} |")
    return "\n".join(lines)


def each_in_its_own_process(script: str, configs: list, args, passed: tuple, name, extra: list = ()) -> list[dict]:
    """Run `script --one CONFIG` for each config, one process each (an engine and its worker in it), passing on the
    `passed` arguments; each config's result row, printed as it comes. `name(config)` labels a failure."""
    rows = []
    for config in configs:
        given = {k: v for k, v in vars(args).items() if k in passed and v is not None}
        command = [sys.executable, script, "--one", json.dumps(config)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in given.items()] + list(extra)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        found = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
        if run.returncode or not found:
            sys.exit(f"{name(config)} failed:\n{run.stderr[-4000:]}")
        rows.append(json.loads(found[-1][len("RESULT"):]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def append_rows(out: Path, rows: list[dict]) -> None:
    """Add this run's rows, each with the command that made it, to out/results.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(dict(r, command=" ".join(sys.argv))) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--configs", default="stock,none,snapkv:0.5,snapkv:0.75,snapkv:0.9,kvzap:0.75")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-requests", type=int, default=8, help="KV memory, in uncompressed requests' pages")
    p.add_argument("--eager", action="store_true", help="no torch.compile (kvzap's configs run eagerly anyway)")
    p.add_argument("--request-settings", default=None,
                   help='every request\'s own kvpress settings (JSON) in the kvpress configs, e.g. {"policy": "none"}')
    p.add_argument("--out", default=None, help="folder for results.jsonl and summary.md")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config (JSON) and print it
    args = p.parse_args(argv)
    if args.one is not None:
        print("RESULT" + json.dumps(run_config(args, json.loads(args.one))))
        return
    rows = each_in_its_own_process(__file__, parse_configs(args.configs), args,
                                   ("model", "requests", "prompt_tokens", "new_tokens", "kv_requests",
                                    "request_settings"), label,
                                   ["--eager"] * args.eager)
    print(table(rows))
    if args.out:
        append_rows(Path(args.out), rows)


if __name__ == "__main__":
    main()
