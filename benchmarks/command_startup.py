"""How long `kvpress --help` and bare `kvpress` take to answer, each a new interpreter (what a user waits for), and
`kvpress compress --help`, which loads torch and transformers, for comparison.

    python benchmarks/command_startup.py --runs 5

Prints the median and the slowest of the runs per command. Arithmetic floor: a bare Python start (`python -c
pass`), printed first; the issue's bound for `kvpress --help` is 2 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c pass (floor)": [sys.executable, "-c", "pass"],
    "kvpress --help": [sys.executable, "-m", "kvpress.cli", "--help"],
    "kvpress": [sys.executable, "-m", "kvpress.cli"],
    "kvpress compress --help": [sys.executable, "-m", "kvpress.cli", "compress", "--help"],
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per command, interleaved (default 5)")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    times = {name: [] for name in COMMANDS}
    for _ in range(args.runs):  # the commands alternate, so a busy moment falls on all of them
        for name, command in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(command, env=env, cwd=ROOT, capture_output=True, check=True)
            times[name].append(time.perf_counter() - start)
    floor = statistics.median(times["python -c pass (floor)"])
    for name, got in times.items():
        print(f"{name:<26} median {statistics.median(got):6.3f} s  slowest {max(got):6.3f} s  "
              f"({statistics.median(got) / floor:5.1f}x the bare interpreter)")


if __name__ == "__main__":
    main()
