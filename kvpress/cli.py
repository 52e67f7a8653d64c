"""`kvpress <command>`: the library's command line (today: `kvpress calibrate`; evals are `kvpress-eval`)."""

from __future__ import annotations

import sys

COMMANDS = {"calibrate": "kvpress.calibration"}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: kvpress {{{','.join(COMMANDS)}}} ...; got {argv[:1] or 'nothing'}")
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
