"""`kvpress <command>`: the library's command line. Each command is a `main(argv)` in the module named below, imported
only when that command runs, so that `kvpress` and `kvpress --help` answer without loading torch."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # name -> ("module:function", what it does)
    "compress": ("kvpress.commands:compress_main", "compress a text file's KV cache once and save it (.kvpress)"),
    "ask": ("kvpress.commands:ask_main", "answer questions over a saved .kvpress context (no prefill)"),
    "eval": ("evals.cli:main", "score policies on the RULER-style, LongBench and needle suites (= kvpress-eval)"),
    "serve": ("kvpress.commands:serve_main", "vLLM's OpenAI-compatible server with a kvpress policy, checked first"),
    "calibrate": ("kvpress.calibration:main", "fit a model's KVzap predictor, head ranking and codebooks"),
    "demo": ("kvpress.demo:main", "compress a document once, ask it questions, save and load it (`make demo`)"),
}
USAGE = "usage: kvpress {" + ",".join(COMMANDS) + "} [options]   (kvpress <command> --help for a command's options)\n\n" + \
    "\n".join(f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items()) + "\n"


class ShowDefaults(argparse.RawDescriptionHelpFormatter):
    """--help with each option's default where it has one (not None, False or empty) and its help does not already
    say it; descriptions as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in text and \
                action.option_strings:
            text += " (default: %(default)s)"
        return text


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[:1] in (["-h"], ["--help"]):  # bare `kvpress` lists its commands
        print(USAGE, end="")
        raise SystemExit(0)
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"{USAGE}kvpress: error: {argv[0]!r}; allowed values: {', '.join(COMMANDS)}\n")
        raise SystemExit(2)
    module, function = COMMANDS[argv[0]][0].split(":")
    getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()
