"""Self-speculative decoding on SmolLM2: when does it pay? Speedup over plain greedy `generate` on the same cache,
by prompt length, draft kind, gamma and draft budget (CPU here; GPU if present).

Prompt: a document of the demo's haystack sentences, then a request to retell it (a long answer). Both runs stop at
EOS the same way (no forced length), and tokens/s count the tokens actually generated.

Each prompt is prefilled ONCE per length (and per target cache: quant4's target is the 8-bit KIVI cache, the others
read the full cache), in chunks of --chunk tokens, up to its last token. Every run, plain or speculative, then decodes
from its own fork of that cache (KVPressCache.fork: shared tensors, copy-on-append), so the decode phases all start
from the same state and each run's wall clock covers the same work: the last prompt token, then the new tokens.
  decode tok/s: new tokens / that wall clock;  e2e speedup: (prefill + plain decode) / (prefill + speculative decode)
  with the one prefill of that target;  identical: the speculative ids equal plain greedy decoding's (they must).

    python benchmarks/speculative.py --contexts 4096,16384,32768 --drafts sink_window,retrieval,quest,quant4 \\
        --gammas 3,5 --budget-fracs 0.05,0.1 --new-tokens 64 --out docs/results/speculative_cpu

Layer-skip drafts (speculative/layer_skip.py) read the whole cache and skip decoder layers: `skip:M` skips the M
layers CLaSp chooses (again every --reselect-every rounds), `skip:A-B` layers A to B always.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.models import load
from kvpress.needle import haystack_sentences
from kvpress.speculative import DRAFTS

DEFAULT_DRAFTS = "sink_window,retrieval,quest,quant4"
QUANT4_TARGET = dict(bits=8)  # quant4 drafts from the upper 4 bits of the 8-bit codes its target reads whole


def retell_prompt(tok, n_tokens: int, seed: int = 3):
    """Chat-formatted ids of about n_tokens (at most): haystack sentences, then a request to retell them. Grown in
    steps of ~64 sentences, then one at a time, so a 32K prompt is not re-tokenised 2,000 times."""
    request = "\n\nRetell the document above in your own words, in detail, sentence by sentence."
    sentences = haystack_sentences(seed)

    def ids_of(parts):
        prompt = tok.apply_chat_template([{"role": "user", "content": " ".join(parts) + request}],
                                         add_generation_prompt=True, tokenize=False)
        return tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids

    parts: list[str] = []
    pending: list[str] = []  # sentences drawn but not taken: the 1-step pass tries them first, in order
    for step in (64, 1):
        while True:
            more = [pending.pop(0) if pending else next(sentences) for _ in range(step)]
            if ids_of(parts + more).shape[1] > n_tokens:
                pending = more + pending
                break
            parts += more
    return ids_of(parts)


def _kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # fp32 K and V


def _available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def prefill(model, ids, chunk: int):
    """A KVPressCache holding ids[:, :-1] (the patched model's policy applied), and the seconds it took."""
    cache = KVPressCache(model.config)
    start = time.perf_counter()
    with torch.no_grad():
        # logits of the last position only: 32K x 49K fp32 logits would be 6 GiB
        # cache=: a patched model takes the current name on every transformers kvpress allows
        model(ids[:, :-1], cache=cache, attention_mask=torch.ones_like(ids[:, :-1]), logits_to_keep=1)
    return cache, time.perf_counter() - start


def skip_layers(draft: str):
    """skip_layers of a `skip:...` draft (an int for CLaSp, a list of indices for a fixed range), else None."""
    if not draft.startswith("skip:"):
        return None
    spec = draft.split(":", 1)[1]
    if "-" in spec:
        first, last = map(int, spec.split("-"))
        return list(range(first, last + 1))
    return int(spec)


def run_length(model, tok, n, args, device):
    """Rows of the table for one prompt length."""
    ids = retell_prompt(tok, n).to(device)
    eos = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    drafts = args.drafts.split(",")
    rows, prefills = [], {}
    targets = (["none"] if any(d != "quant4" for d in drafts) else []) + (["kivi"] if "quant4" in drafts else [])
    for target in targets:
        params = QUANT4_TARGET if target == "kivi" else {}
        with kvpress.patch_model(model, target, prefill_chunk_size=args.chunk, **params):
            cache, prefill_s = prefill(model, ids, args.chunk)
            prefills[target] = prefill_s
            print(f"  {ids.shape[1]} tokens, target {target}{'-8bit' if params else ''}: prefill {prefill_s:.1f} s "
                  f"({prefill_s / ids.shape[1] * 1024:.2f} s per 1K tokens)", flush=True)
            start = time.perf_counter()
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache.fork(), do_sample=False,
                                 max_new_tokens=args.new_tokens, **eos)
            plain_s = time.perf_counter() - start
            n_new = ref.shape[1] - ids.shape[1]
            for draft in [d for d in drafts if (d == "quant4") == (target == "kivi")]:
                skipped = skip_layers(draft)
                budgets = [None] if draft == "quant4" or skipped is not None else \
                    [max(16, int(float(f) * ids.shape[1])) for f in args.budget_fracs.split(",")]
                for budget in budgets:
                    for gamma in [g if g == "adaptive" else int(g) for g in args.gammas.split(",")]:
                        start = time.perf_counter()
                        skipping = {} if skipped is None else dict(skip_layers=skipped,
                                                                   reselect_every=args.reselect_every)
                        out, stats = kvpress.speculative_generate(
                            model, ids, draft=None if skipped is not None else draft, gamma=gamma,
                            max_new_tokens=args.new_tokens, draft_budget=budget, cache=cache.fork(),
                            return_stats=True, **skipping, **eos)
                        spec_s = time.perf_counter() - start
                        row = dict(prompt=ids.shape[1], draft=draft, gamma=gamma,
                                   budget="4 of 8 bits" if draft == "quant4" else "all" if budget is None else budget,
                                   acceptance=stats.acceptance_rate, per_round=stats.tokens_per_round,
                                   draft_share=stats.draft_s / max(stats.total_s, 1e-9),
                                   spec_tps=stats.emitted / spec_s, plain_tps=n_new / plain_s,
                                   decode_speedup=plain_s / spec_s,
                                   e2e_speedup=(prefill_s + plain_s) / (prefill_s + spec_s),
                                   new=n_new, identical=out.tolist() == ref.tolist())
                        rows.append(row)
                        print(_line(row), flush=True)
            del cache
    return rows, prefills


COLUMNS = [("prompt", "prompt tokens", "{}"), ("draft", "draft", "{}"), ("gamma", "gamma", "{}"),
           ("budget", "draft budget", "{}"), ("acceptance", "acceptance", "{:.0%}"),
           ("per_round", "tokens/round", "{:.2f}"), ("draft_share", "draft time", "{:.0%}"),
           ("spec_tps", "spec decode tok/s", "{:.2f}"), ("plain_tps", "plain decode tok/s", "{:.2f}"),
           ("decode_speedup", "decode speedup", "{:.2f}x"), ("e2e_speedup", "e2e speedup", "{:.2f}x"),
           ("new", "new tokens", "{}"), ("identical", "identical", "{}")]


def _line(row) -> str:
    return " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS)


def markdown(rows, prefills, command, machine) -> str:
    out = ["# Self-speculative decoding on CPU: speedup over plain greedy generate", "",
           f"Command: `{command}`", "", f"Machine: {machine}", "",
           "SmolLM2-135M-Instruct fp32, greedy. Each prompt is prefilled once per length and target cache (quant4's "
           "target: 8-bit KIVI; the others: the full cache); every run decodes from its own fork of that prefill. "
           "decode tok/s: new tokens / wall clock from the prefilled state (last prompt token + new tokens). "
           "e2e speedup: (prefill + plain decode) / (prefill + speculative decode). tokens/round: tokens committed per "
           "verification forward. draft time: share of the speculative call spent in draft forwards. "
           "SmolLM2 was trained to 8,192 positions: acceptance beyond that reflects an out-of-range model.", "",
           "| prefill | seconds | s per 1K tokens |", "|---|---|---|"]
    out += [f"| {n} tokens, target {t} | {s:.1f} | {s / n * 1024:.2f} |" for (n, t), s in prefills.items()]
    out += ["", "| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + _line(row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="4096,16384,32768", help="prompt lengths in tokens")
    parser.add_argument("--drafts", default=DEFAULT_DRAFTS, help=f"comma-separated, from {sorted(DRAFTS)}")
    parser.add_argument("--gammas", default="3,5", help="draft tokens per round (ints, or adaptive)")
    parser.add_argument("--budget-fracs", default="0.1", help="draft budgets, as fractions of the prompt")
    parser.add_argument("--reselect-every", type=int, default=1, help="skip:M drafts: rounds between CLaSp's choices")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (bounds the prefill's memory)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="folder for summary.md (e.g. docs/results/speculative_cpu)")
    args = parser.parse_args(argv)
    # the chunked-prefill wrapper hides the forward's signature, so kvpress passes the cache under its old name and
    # transformers warns on every call; the cache is used either way (a kvpress integrations issue, not this script's)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    unknown = [d for d in args.drafts.split(",") if d not in DRAFTS and not d.startswith("skip:")]
    if unknown:
        parser.error(f"--drafts {','.join(unknown)} unknown; allowed values: {sorted(DRAFTS)}, skip:M, skip:A-B")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load("smollm2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
               f"{torch.get_num_threads()} torch threads, {device}, torch {torch.__version__}")
    print(f"SmolLM2-135M-Instruct fp32 | greedy | {machine} | {args.new_tokens} new tokens at most")
    print(" | ".join(title for _, title, _ in COLUMNS))
    rows, prefills = [], {}
    per_token = _kv_bytes_per_token(model.config)
    for n in [int(x) for x in args.contexts.split(",")]:
        free = _available_bytes()
        # the prefilled cache, a fork growing beside it, and the prefill's chunk working set
        need = 3 * n * per_token + (2 << 30)
        if device == "cpu" and free is not None and need > free:
            print(f"  {n} tokens skipped: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free", flush=True)
            continue
        length_rows, length_prefills = run_length(model, tok, n, args, device)
        rows += length_rows
        prefills.update({(length_rows[0]["prompt"] if length_rows else n, t): s for t, s in length_prefills.items()})
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        command = "python " + " ".join(["benchmarks/speculative.py", *(argv if argv is not None else sys.argv[1:])])
        (folder / "summary.md").write_text(markdown(rows, prefills, command, machine))
        print(f"wrote {folder / 'summary.md'}")


if __name__ == "__main__":
    main()
