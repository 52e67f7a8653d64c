"""The accuracy-per-byte frontier over several eval result folders (each run with evals.cli): their rows pooled
(a sample scored by two folders for the same config counts once), then, per mode and length, the best config at
each byte budget and the frontier (evals/report.py), and the plot. Bytes are each config's KVPressCache.nbytes()
after prefill as a fraction of the full cache's on the same tasks.

    python benchmarks/frontier.py --mode query_agnostic --budgets 0.05,0.12,0.25 \
        --dirs docs/results/kvzap_every_token,docs/results/query_agnostic_smollm2_bf16,docs/results/kvzap_kivi,\
docs/results/zipcache --out docs/results/zipcache/frontier_query_agnostic.png

Folders must come from one model, dtype and suite; the first folder that has a sample's full-cache row gives it.
"""

from __future__ import annotations

import argparse

from evals.report import frontier_markdown, plot_accuracy_per_byte, read_rows, summarize

SAMPLE = ("task", "index", "length", "mode", "policy", "ratio", "question")  # one scored answer


def pooled(dirs: list[str]) -> list[dict]:
    rows, seen = [], set()
    for folder in dirs:
        for row in read_rows(folder):
            key = tuple(row.get(k) for k in SAMPLE)
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirs", required=True, help="comma list of evals.cli --out folders")
    p.add_argument("--mode", default="query_agnostic")
    p.add_argument("--budgets", default="0.05,0.12,0.25", help="byte budgets (fractions of the full cache)")
    p.add_argument("--out", default=None, help="where to draw the plot (.png); none: no plot")
    args = p.parse_args(argv)
    rows = [r for r in pooled(args.dirs.split(",")) if r["mode"] == args.mode]
    if not rows:
        raise SystemExit(f"no rows with mode={args.mode!r} in {args.dirs}")
    budgets = tuple(float(b) for b in args.budgets.split(","))
    summary = summarize(rows)
    print(frontier_markdown(summary, budgets))
    if args.out:
        plot_accuracy_per_byte(summary, args.out, args.mode, budgets)
        print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
