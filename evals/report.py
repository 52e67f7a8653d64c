"""Results on disk: JSON lines in, CSV summary, markdown table and plots out."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from pathlib import Path

CELL = ("task", "length", "mode", "policy", "ratio")


def read_rows(out_dir) -> list[dict]:
    """Every row of every results*.jsonl in out_dir (one file per shard); a torn last line is skipped."""
    rows = []
    for path in sorted(Path(out_dir).glob("results*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by an interrupted run; that sample is simply redone
    return rows


def _mean(values):
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (task, length, mode, policy, ratio): mean score (x100, as RULER and LongBench report),
    mean KV bytes after prefill, mean prefill and decode seconds."""
    cells = defaultdict(list)
    for r in rows:
        cells[tuple(r[k] for k in CELL)].append(r)
    out = []
    for key in sorted(cells, key=lambda k: tuple(str(x) if isinstance(x, str) else f"{x:012.4f}" for x in k)):
        rs = cells[key]
        out.append(dict(zip(CELL, key), n=len(rs), score=round(100 * _mean([r["score"] for r in rs]), 2),
                        kv_bytes=round(_mean([r["kv_bytes"] for r in rs])),
                        prefill_s=round(_mean([r["prefill_s"] for r in rs]), 3),
                        decode_s=round(_mean([r["decode_s"] for r in rs]), 3),
                        new_tokens=round(_mean([r["new_tokens"] for r in rs]), 1)))
    return out


def write_csv(summary: list[dict], path) -> None:
    _atomic(path, lambda f: (w := csv.DictWriter(f, fieldnames=list(summary[0]) if summary else list(CELL)),
                             w.writeheader(), w.writerows(summary)))


def markdown(summary: list[dict]) -> str:
    """Per mode and length: policy x ratio rows, one column per task, then the average and the KV cache kept."""
    parts = []
    for mode in sorted({s["mode"] for s in summary}):
        for length in sorted({s["length"] for s in summary if s["mode"] == mode}, key=lambda x: (x is None, x)):
            cells = [s for s in summary if s["mode"] == mode and s["length"] == length]
            tasks = sorted({s["task"] for s in cells})
            configs = sorted({(s["policy"], s["ratio"]) for s in cells}, key=lambda c: (c[0] != "none", c))
            full = {s["task"]: s["kv_bytes"] for s in cells if s["policy"] == "none"}
            parts.append(f"**{mode}, {length} tokens** (score x100; n = samples per cell)\n")
            parts.append("| policy | ratio | " + " | ".join(tasks) + " | average | KV kept |")
            parts.append("|---|---|" + "---|" * (len(tasks) + 2))
            for policy, ratio in configs:
                by_task = {s["task"]: s for s in cells if (s["policy"], s["ratio"]) == (policy, ratio)}
                scores = [by_task[t]["score"] if t in by_task else float("nan") for t in tasks]
                kept = [by_task[t]["kv_bytes"] / full[t] for t in tasks if t in by_task and full.get(t)]
                shown = ["" if math.isnan(x) else f"{x:.1f}" for x in scores]
                parts.append(f"| {policy} | {ratio:.2f} | " + " | ".join(shown) + f" | {_mean(scores):.1f} | "
                             + (f"{_mean(kept):.0%}" if kept else "") + " |")
            n = sorted({s["n"] for s in cells})
            parts.append(f"\nn = {n[0] if len(n) == 1 else n}\n")
    return "\n".join(parts)


def plot_accuracy(summary: list[dict], path, mode: str) -> None:
    """Score vs compression ratio: one panel per task (and the average), one line per policy and length;
    policies that take no ratio ("none") are horizontal references."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [s for s in summary if s["mode"] == mode]
    tasks = sorted({s["task"] for s in cells})
    panels = tasks + (["average"] if len(tasks) > 1 else [])
    lengths = sorted({s["length"] for s in cells}, key=lambda x: (x is None, x))
    policies = sorted({s["policy"] for s in cells})
    styles = ["-", "--", ":", "-."]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for p_i, policy in enumerate(policies):
            for l_i, length in enumerate(lengths):
                points = defaultdict(list)
                for s in cells:
                    if s["policy"] == policy and s["length"] == length and panel in ("average", s["task"]):
                        points[s["ratio"]].append(s["score"])
                if not points:
                    continue
                xs = sorted(points)
                ys = [_mean(points[x]) for x in xs]
                kw = dict(color="black" if policy == "none" else f"C{p_i}", linestyle=styles[l_i % len(styles)],
                          label=f"{policy} @ {length}" if len(lengths) > 1 else policy)
                if xs == [0.0]:  # a reference without a ratio: a flat line across the plot
                    ax.axhline(ys[0], **kw)
                else:
                    ax.plot(xs, ys, marker="o", markersize=3, **kw)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("compression ratio (fraction of KV removed)", fontsize=7)
        ax.set_ylabel("score", fontsize=7)
        ax.set_ylim(-3, 103)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08 if len(labels) > 6 else 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(out_dir) -> list[Path]:
    """summary.csv, summary.md, accuracy_vs_ratio_<mode>.png, and needle_heatmap_<mode>.png for needle rows."""
    out_dir = Path(out_dir)
    rows = read_rows(out_dir)
    if not rows:
        return []
    summary = summarize(rows)
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    write_csv(summary, written[0])
    _atomic(written[1], lambda f: f.write(markdown(summary)))
    for mode in sorted({s["mode"] for s in summary}):
        path = out_dir / f"accuracy_vs_ratio_{mode}.png"
        plot_accuracy(summary, path, mode)
        written.append(path)
        needle_rows = [r for r in rows if r["task"] == "needle" and r["mode"] == mode]
        if needle_rows:
            from .needle import heatmap

            path = out_dir / f"needle_heatmap_{mode}.png"
            heatmap(needle_rows, path)
            written.append(path)
    return written


def _atomic(path, write) -> None:
    """Write through a temporary file, so a reader (or another shard) never sees half a file."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        write(f)
    os.replace(tmp, path)
