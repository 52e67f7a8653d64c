"""Scores of several eval runs on the samples they all answered (paired), from kvpress-eval's results*.jsonl files.

Runs made at different times with different --n, or one policy added later on a few samples, are compared only
on the (task, sample, length, mode) they share, so a difference is not a difference of samples.

  python benchmarks/paired_scores.py docs/results/query_agnostic_smollm2_bf16 \\
      docs/results/calibration/kvzip_plus_target --ratios 0.5,0.75 \\
      --policies none,kvzip,kvzap,kvzap:calibration=/tmp/exp/smol_plus.safetensors
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folders):
    rows = []
    for folder in folders:
        for path in sorted(Path(folder).glob("results*.jsonl")):
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="folders holding results*.jsonl")
    parser.add_argument("--policies", required=True, help="comma list of policy specs as written in the results")
    parser.add_argument("--ratios", default="0.5,0.75", help="compression ratios ('none' and ratio-free policies: "
                                                            "their one ratio is used)")
    parser.add_argument("--versus", default=None,
                        help="a policy of --policies: also print each other policy's paired difference from it, "
                             "+- one standard error of the paired mean")
    args = parser.parse_args(argv)
    rows = load(args.folders)
    policies = args.policies.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    known = {r["policy"] for r in rows}
    missing = [p for p in policies if p not in known]
    if missing:
        raise SystemExit(f"--policies: {missing} not in the results; allowed values: {sorted(known)}")
    if args.versus is not None and args.versus not in policies:
        raise SystemExit(f"--versus: {args.versus!r} is not one of --policies; allowed values: {policies}")

    def cells(policy, ratio):
        own = [r for r in rows if r["policy"] == policy]
        if len({r["ratio"] for r in own}) == 1:  # a ratio-free policy (none, a head split)
            ratio = own[0]["ratio"]
        return {(r["task"], r["index"], r["length"], r["mode"]): r["score"] for r in own if r["ratio"] == ratio}

    print("| ratio | " + " | ".join(policies) + " | paired samples |\n|---|" + "---|" * (len(policies) + 1))
    for ratio in ratios:
        scored = [cells(p, ratio) for p in policies]
        shared = set.intersection(*(set(s) for s in scored))
        means = [100 * sum(s[k] for k in shared) / max(1, len(shared)) for s in scored]
        print(f"| {ratio} | " + " | ".join(f"{m:.1f}" for m in means) + f" | {len(shared)} |")
        if args.versus is not None:
            base = scored[policies.index(args.versus)]
            for policy, s in zip(policies, scored):
                if policy != args.versus and shared:
                    d = [100 * (s[k] - base[k]) for k in shared]
                    mean = sum(d) / len(d)
                    se = (sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1) / len(d)) ** 0.5
                    print(f"  {ratio}: {policy} - {args.versus} = {mean:+.1f} +- {se:.1f} (better on "
                          f"{sum(x > 0 for x in d)}, worse on {sum(x < 0 for x in d)})")


if __name__ == "__main__":
    main()
