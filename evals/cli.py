"""kvpress-eval: score KV-cache policies and compression ratios on long-context tasks.

  kvpress-eval --model smollm2 --task ruler --lengths 2048,4096 --policies none,snapkv,h2o,streaming_llm \\
               --ratios 0.5,0.75,0.9 --n 50 --out results/

Writes to --out: results.jsonl (one row per sample, question, policy and ratio; results.shard-I-of-N.jsonl
when sharded), summary.csv, summary.md, accuracy_vs_ratio_<mode>.png (and needle_heatmap_<mode>.png), and
runs.jsonl (each invocation's command line and wall time). A rerun skips every finished (sample, policy,
ratio, mode). Each sample is prefilled once for all policies and ratios (see evals/engine.py).

Sharding: --shard I/N takes every N-th sample from the I-th; under torchrun or accelerate launch the shard
comes from RANK / WORLD_SIZE and the device from LOCAL_RANK, and rank 0 writes the summary once all ranks are
done. Separate --shard processes each rewrite the summary when they finish; `--summarize` rebuilds it.

  torchrun --nproc_per_node 8 -m evals.cli --model PATH --task ruler --samples 50 --out results/
  accelerate launch -m evals.cli --model PATH --task ruler --samples 50 --out results/

A model too big for one device: --tensor-parallel shards its heads over the ranks (transformers' tp_plan) and
every rank runs every sample; rank 0 writes the same rows one process would.

  torchrun --nproc_per_node 2 -m evals.cli --model PATH --tensor-parallel --task ruler --samples 20 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from kvpress.cli import ShowDefaults

from .plan import SUITES, Plan, check_outputs, make_plan, make_sample, row_key, work_items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpress-eval", description=__doc__,
                                formatter_class=ShowDefaults)
    p.add_argument("--model", required=True, help="an HF checkpoint folder, or a kvpress model name (smollm2, gemma3)")
    p.add_argument("--task", required=True, help=f"one of {', '.join(SUITES)}")
    p.add_argument("--subtasks", default=None,
                   help="comma list (ruler: default the 6-task suite, 'all' for every task; longbench: datasets)")
    p.add_argument("--lengths", default="2048", help="prompt tokens, comma list (longbench: the truncation budget)")
    p.add_argument("--policies", default="none,snapkv,h2o,streaming_llm",
                   help="comma list of kvpress policies; parameters after colons, e.g. snapkv:budget_allocation=adaptive "
                        "(none, the full cache, is added when missing: every ratio in the summary is to it)")
    p.add_argument("--ratios", default="0.5,0.75,0.9", help="compression ratios (fraction of the KV removed)")
    p.add_argument("--modes", default="query_aware", help="query_aware and/or query_agnostic (comma list)")
    p.add_argument("--n", "--samples", dest="n", type=int, default=10,
                   help="samples per subtask and length (needle: per depth). The defaults are 60 prompts of 2K for "
                        "ruler, ~18.5 s each for SmolLM2 on one CPU thread (the README's per-sample costs): ~20 "
                        "minutes; one sample per task moves a 6-task average by 1.7 points (the README's tables "
                        "use 20). Under torchrun write --samples, as torchrun's own parser claims --n")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated samples (ruler, needle)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    p.add_argument("--questions", type=int, default=1,
                   help="questions per sample over one context (ruler qa / niah_multikey_*)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: each task's own budget; not part of the resume key)")
    p.add_argument("--data", default=None, help="longbench: a LongBench .jsonl file or a folder of them")
    p.add_argument("--shard", default=None, help="I/N: run the I-th of N shards (0-based)")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="under torchrun: shard the model's heads over the ranks (tp_plan='auto') instead of the samples; "
                        "every rank runs every sample, rank 0 writes")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                   help="transformers (kvpress.patch_model), or vllm: the same samples through vLLM serving kvpress "
                        "(run from the environment `make vllm` builds; one engine per config; query_aware only)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="--engine vllm: the engine's KV cache size (GiB)")
    p.add_argument("--page-tokens", type=int, default=128,
                   help="--engine vllm: tokens per KV page (vLLM's block size; a multiple of 32 on CPU). A request "
                        "keeps its budget raised to whole pages: smaller pages keep closer to the ratio")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda:0...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--summarize", action="store_true", help="only rebuild the summary and plots from --out")
    p.add_argument("--no-plots", action="store_true", help="write the summary without plots (no matplotlib needed)")
    p.add_argument("--decode-alone", action="store_true",
                   help="decode each config in a batch of its own, so its decode time is its own (slower); by "
                        "default configs share batches and each row's decode_s is its batch's (column `batch`)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def pick_device(name: str):
    import torch

    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


def load_model(path: Path, device, dtype: str, tensor_parallel: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    if dtype == "auto":
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    if tensor_parallel:  # transformers places each rank's shard (and starts the process group) itself
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                                    tp_plan="auto").eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


def run(args) -> dict:
    """Validate, evaluate what is missing, write the summary. Returns counts and wall time."""
    started = time.time()
    if args.summarize:
        from .report import write_all

        check_outputs(args)
        if not Path(args.out).is_dir() or not any(Path(args.out).glob("results*.jsonl")):
            raise ValueError(f"--out={args.out!r} holds no results*.jsonl to summarize; allowed values: the folder of "
                             f"an earlier kvpress-eval run")
        return dict(written=[str(p) for p in write_all(args.out, plots=not args.no_plots)])
    plan = make_plan(args)

    import torch
    from transformers import AutoTokenizer

    from kvpress.progress import reporting, task

    from .report import read_rows, write_all

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plan.out.mkdir(parents=True, exist_ok=True)
    i, n = plan.shard
    results = plan.out / ("results.jsonl" if n == 1 else f"results.shard-{i}-of-{n}.jsonl")
    # tensor parallel: every rank computes every row (the forwards are collective), rank 0 alone writes them
    writer = not args.tensor_parallel or int(os.environ.get("RANK", "0")) == 0
    done = {row_key(r.get("model"), r) for r in read_rows(plan.out)}
    tokenizer = AutoTokenizer.from_pretrained(plan.model_path)
    items = work_items(plan)
    # samples x modes through transformers; samples x configs through vLLM (config by config)
    total = len(items) * (len(plan.configs) if args.engine == "vllm" else len(plan.modes))
    with reporting(not args.no_progress), \
            task(f"eval {plan.suite}" + (f" shard {i}/{n}" if n > 1 else ""), total, unit="sample") as bar:
        if args.engine == "vllm":
            with open(results, "a", encoding="utf-8") as sink:
                counts = _run_engine(plan, args, tokenizer, items, done, sink, bar)
        else:
            counts = _run_transformers(plan, args, tokenizer, items, done, results if writer else os.devnull, bar)
    wall = time.time() - started
    if not writer:
        return dict(counts, wall_s=round(wall, 1))
    with open(plan.out / "runs.jsonl", "a", encoding="utf-8") as f:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds and the load average say how much of the wall time was this run's (the CPU may be shared)
        f.write(json.dumps(dict(command=sys.argv, shard=f"{i}/{n}", wall_s=round(wall, 1), **counts,
                                cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
                                loadavg_at_end=[round(x, 2) for x in os.getloadavg()],
                                threads=torch.get_num_threads(), engine=args.engine,
                                device="cpu" if args.engine == "vllm" else str(pick_device(args.device)),
                                torch=torch.__version__)) + "\n")
    if _is_last_writer(n, args.shard):
        counts["written"] = [str(p) for p in write_all(plan.out, plots=not args.no_plots)]
    counts["wall_s"] = round(wall, 1)
    return counts


def _missing(plan: Plan, sample, length: int, mode: str, done: set) -> list:
    """The configs of `plan` with a question of `sample` not yet answered in `mode`."""
    probe = dict(task=sample.task, length=length, index=sample.index, depth=sample.meta.get("depth"), mode=mode,
                 seed=sample.meta.get("seed"))
    return [c for c in plan.configs
            if any(row_key(plan.model, dict(probe, policy=c.policy, ratio=c.ratio, question=q)) not in done
                   for q in range(len(sample.questions)))]


def _write(sink, plan: Plan, rows: list, length: int | None = None) -> None:
    for row in rows:
        row["model"] = plan.model
        if length is not None:
            row["length"] = length
        sink.write(json.dumps(row) + "\n")
    sink.flush()


def _run_transformers(plan: Plan, args, tokenizer, items: list, done: set, results, bar) -> dict:
    """Each sample prefilled once for its missing configs (evals/engine.py), sample by sample."""
    from .runner import evaluate

    model, device = None, pick_device(args.device)
    counts = dict(evaluated=0, skipped=0)
    with open(results, "a", encoding="utf-8") as sink:
        for subtask, length, index in items:
            sample = make_sample(plan, tokenizer, subtask, length, index, args)
            if args.max_new_tokens:
                sample.max_new_tokens = min(sample.max_new_tokens, args.max_new_tokens)
            for mode in plan.modes:
                bar.advance(0, note=f"{subtask} {length} #{index} {mode}")
                missing = _missing(plan, sample, length, mode, done)
                if missing:
                    if model is None:  # only when there is work: a finished run resumes without loading it
                        model = load_model(plan.model_path, device, args.dtype, args.tensor_parallel)
                    _write(sink, plan, evaluate(model, tokenizer, sample, missing, mode, args.decode_alone), length)
                    counts["evaluated"] += 1
                else:
                    counts["skipped"] += 1
                bar.advance()
    return counts


def _run_engine(plan: Plan, args, tokenizer, items: list, done: set, sink, bar) -> dict:
    """--engine vllm: config by config, every sample still missing it through one engine (evals/vllm_engine.py)."""
    from transformers import GenerationConfig

    from . import vllm_engine

    samples = []
    for subtask, length, index in items:
        sample = make_sample(plan, tokenizer, subtask, length, index, args)
        if args.max_new_tokens:
            sample.max_new_tokens = min(sample.max_new_tokens, args.max_new_tokens)
        samples.append((sample, length))
    eos = GenerationConfig.from_pretrained(plan.model_path).eos_token_id
    stop = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                   *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    counts = dict(evaluated=0, skipped=0)
    for mode in plan.modes:
        for config in plan.configs:
            work = [(sample, length) for sample, length in samples if config in _missing(plan, sample, length, mode,
                                                                                        done)]
            counts["skipped"] += len(samples) - len(work)
            if work:
                bar.advance(0, note=f"{config.policy} {config.ratio} {mode}: {len(work)} samples through vLLM")
                rows = vllm_engine.evaluate(plan.model_path, tokenizer, work, config, args.dtype,
                                            int(args.kv_cache_gib * 2**30), stop, args.page_tokens, mode)
                by_sample = {}
                for row in rows:
                    by_sample.setdefault((row["task"], row["index"]), []).append(row)
                for sample, length in work:
                    _write(sink, plan, by_sample[(sample.task, sample.index)], length)
                counts["evaluated"] += len(work)
        bar.advance(len(samples))
    return counts


def _is_last_writer(n_shards: int, shard_flag: str | None) -> bool:
    """Under torchrun / accelerate launch: wait for every rank, then rank 0 writes. Otherwise every process
    writes (the summary reads every shard's file, so the last to finish has it all)."""
    if n_shards == 1 or shard_flag is not None or "MASTER_ADDR" not in os.environ:
        return True
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=7))
    dist.barrier()
    last = dist.get_rank() == 0
    dist.destroy_process_group()
    return last


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = run(args)
    except ValueError as e:
        parser.exit(2, f"kvpress-eval: error: {e}\n")
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
