"""Two kvpress-eval result folders, row by row: the same samples answered two ways (e.g. the transformers path and
vLLM serving kvpress: `kvpress-eval --engine vllm`). Per (policy, ratio): the average score of each (x100, averaged
over tasks as kvpress-eval's summary does), their difference, and how many answers are the same text.

    python benchmarks/compare_runs.py docs/results/vllm_ruler/transformers docs/results/vllm_ruler/engine
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows(folder: Path) -> dict:
    out = {}
    for path in sorted(folder.glob("results*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[(r["policy"], r["ratio"], r["mode"], r["length"], r["task"], r["index"], r["question"])] = r
    return out


def task_average(scores: dict) -> float:
    """x100 average over tasks of each task's mean score ({task: [scores]})."""
    return 100 * sum(sum(s) / len(s) for s in scores.values()) / len(scores)


def compare(a: dict, b: dict) -> list[dict]:
    shared = sorted(set(a) & set(b))
    groups = defaultdict(list)
    for key in shared:
        groups[key[:4]].append(key)
    table = []
    for (policy, ratio, mode, length), keys in sorted(groups.items()):
        sa, sb = defaultdict(list), defaultdict(list)
        for k in keys:
            sa[k[4]].append(a[k]["score"])
            sb[k[4]].append(b[k]["score"])
        same = sum(a[k]["prediction"].strip() == b[k]["prediction"].strip() for k in keys)
        table.append(dict(policy=policy, ratio=ratio, mode=mode, length=length, samples=len(keys),
                          a=task_average(sa), b=task_average(sb), same_answers=same))
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args(argv)
    table = compare(rows(args.a), rows(args.b))
    print(f"| policy | ratio | length | samples | {args.a.name} | {args.b.name} | difference | same answers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['policy']} | {r['ratio']} | {r['length']} | {r['samples']} | {r['a']:.1f} | {r['b']:.1f} | "
              f"{r['b'] - r['a']:+.1f} | {r['same_answers']}/{r['samples']} |")


if __name__ == "__main__":
    main()
