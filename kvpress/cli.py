"""`kvpress <command>`: the library's command line (`kvpress calibrate`, `kvpress demo`; evals are `kvpress-eval`)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "calibrate": ("kvpress.calibration", "fit a model's KVzap predictor and head ranking (kvpress/calibration.py)"),
    "demo": ("kvpress.demo", "compress a document once, ask it questions, save and load it (what `make demo` runs)"),
}
USAGE = "usage: kvpress {" + ",".join(COMMANDS) + "} [options]   (kvpress <command> --help for a command's options)\n\n" + \
    "\n".join(f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items()) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "no command"
        sys.stderr.write(f"{USAGE}kvpress: error: {got}; allowed values: {', '.join(COMMANDS)}\n")
        raise SystemExit(2)
    importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    main()
