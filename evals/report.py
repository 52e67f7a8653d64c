"""Results on disk: JSON lines in, CSV summary, markdown tables and plots out.

Besides score per (policy, ratio), every config is placed at the bytes its cache really held after prefill
(KVPressCache.nbytes(), in the dtype of the run) as a fraction of the full cache's: the accuracy-vs-bytes
frontier (configs no other config beats with fewer bytes) and the best config at <= 10% / 25% / 50% of the
bytes, per mode and length."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from pathlib import Path

CELL = ("task", "length", "mode", "policy", "ratio")
BYTE_BUDGETS = (0.10, 0.25, 0.50)


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
                        cache_bytes=round(_mean([r.get("cache_bytes", r["kv_bytes"]) for r in rs])),
                        prefill_s=round(_mean([r["prefill_s"] for r in rs]), 3),
                        decode_s=round(_mean([r["decode_s"] for r in rs]), 3),
                        new_tokens=round(_mean([r["new_tokens"] for r in rs]), 1),
                        # configs that shared each decode batch (and so its decode_s); 1: timed alone
                        decode_batch=max(r.get("batch", 1) for r in rs)))
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
            full = {s["task"]: s["cache_bytes"] for s in cells if s["policy"] == "none"}
            parts.append(f"**{mode}, {length} tokens** (score x100; n = samples per cell; bytes held: the cache's "
                         f"bytes after prefill, positions included, of the full cache's, as in Accuracy per byte)\n")
            parts.append("| policy | ratio | " + " | ".join(tasks) + " | average | bytes held |")
            parts.append("|---|---|" + "---|" * (len(tasks) + 2))
            for policy, ratio in configs:
                by_task = {s["task"]: s for s in cells if (s["policy"], s["ratio"]) == (policy, ratio)}
                scores = [by_task[t]["score"] if t in by_task else float("nan") for t in tasks]
                kept = [by_task[t]["cache_bytes"] / full[t] for t in tasks if t in by_task and full.get(t)]
                shown = ["" if math.isnan(x) else f"{x:.1f}" for x in scores]
                parts.append(f"| {policy} | {ratio:.2f} | " + " | ".join(shown) + f" | {_mean(scores):.1f} | "
                             + (f"{_mean(kept):.1%}" if kept else "") + " |")
            n = sorted({s["n"] for s in cells})
            parts.append(f"\nn = {n[0] if len(n) == 1 else n}\n")
            parts.append(_speed_markdown(cells, configs))
    return "\n".join(parts)


def _speed_markdown(cells: list[dict], configs: list) -> str:
    """Decode time per config, saying whether each config was timed alone or shared a batch with others (then the
    time is the batch's, the same for every config in it, and does not compare configs: --decode-alone does)."""
    lines = ["| policy | ratio | decode s per answer | answer tokens | tokens/s | timed |", "|---|---|---|---|---|---|"]
    for policy, ratio in configs:
        rs = [s for s in cells if (s["policy"], s["ratio"]) == (policy, ratio)]
        seconds, tokens = _mean([s["decode_s"] for s in rs]), _mean([s["new_tokens"] for s in rs])
        batch = max(s.get("decode_batch", 1) for s in rs)
        timed = "alone" if batch == 1 else f"shared: a batch of {batch} configs (the batch's time)"
        rate = f"{tokens / seconds:.1f}" if seconds > 0 and batch == 1 else ""
        lines.append(f"| {policy} | {ratio:.2f} | {seconds:.2f} | {tokens:.1f} | {rate} | {timed} |")
    return "Decode time per config:\n\n" + "\n".join(lines) + "\n"


def accuracy_per_byte(summary: list[dict]) -> list[dict]:
    """Per (mode, length, policy, ratio): score averaged over tasks, and bytes held (nbytes) as a fraction of the
    full cache's (policy 'none') on the same tasks; `frontier` marks configs that no config with fewer or equal
    bytes beats (or matches with fewer bytes)."""
    out = []
    for mode, length in sorted({(s["mode"], s["length"]) for s in summary}, key=lambda k: (k[0], k[1] or 0)):
        cells = [s for s in summary if s["mode"] == mode and s["length"] == length]
        full = {s["task"]: s["cache_bytes"] for s in cells if s["policy"] == "none"}
        tasks = sorted({s["task"] for s in cells})
        points = []
        for policy, ratio in sorted({(s["policy"], s["ratio"]) for s in cells}):
            by_task = {s["task"]: s for s in cells if (s["policy"], s["ratio"]) == (policy, ratio)}
            if set(by_task) != set(tasks) or not all(full.get(t) for t in tasks):
                continue  # a config must cover every task, against a full-cache reference, to be compared
            points.append(dict(mode=mode, length=length, policy=policy, ratio=ratio,
                               score=round(_mean([by_task[t]["score"] for t in tasks]), 2),
                               bytes=round(_mean([by_task[t]["cache_bytes"] / full[t] for t in tasks]), 4),
                               n=min(by_task[t]["n"] for t in tasks)))
        for p in points:
            p["frontier"] = not any((q["bytes"] <= p["bytes"] and q["score"] > p["score"]) or
                                    (q["bytes"] < p["bytes"] and q["score"] >= p["score"]) for q in points)
        out += sorted(points, key=lambda p: (p["bytes"], -p["score"]))
    return out


def best_within(points: list[dict], budget: float, min_n: int = 0) -> dict | None:
    """The highest-scoring config holding at most `budget` of the full cache's bytes (fewer bytes breaks ties),
    among those measured on at least `min_n` samples per task (a few lucky samples do not make a best config)."""
    fits = [p for p in points if p["bytes"] <= budget and p.get("n", 0) >= min_n]
    return max(fits, key=lambda p: (p["score"], -p["bytes"])) if fits else None


def _label(point: dict) -> str:
    return point["policy"] if point["ratio"] == 0 else f"{point['policy']} @ {point['ratio']:.2f}"


def frontier_markdown(summary: list[dict], budgets=BYTE_BUDGETS) -> str:
    points = accuracy_per_byte(summary)
    parts = ["## Accuracy per byte\n",
             "Bytes: KVPressCache.nbytes() after prefill (keys/values or codes, scales, positions), in the dtype of "
             "the run, as a fraction of the full cache's; score: average over tasks (x100). Full = policy none.\n"]
    for mode, length in sorted({(p["mode"], p["length"]) for p in points}, key=lambda k: (k[0], k[1] or 0)):
        cell = [p for p in points if (p["mode"], p["length"]) == (mode, length)]
        reference = next((p for p in cell if p["policy"] == "none"), None)
        full = reference["score"] if reference else float("nan")
        full_n = reference["n"] if reference else 0
        parts.append(f"**{mode}, {length} tokens**: best config at a byte budget (full cache: {full:.1f}, "
                     f"n = {full_n} per task; only configs measured on as many samples per task compete)\n")
        parts.append("| bytes <= | best config | bytes | score | % of full's score | n per task |")
        parts.append("|---|---|---|---|---|---|")
        for budget in budgets:
            best = best_within(cell, budget, full_n)
            if best is None:
                smallest = min((p for p in cell if p.get("n", 0) >= full_n), key=lambda p: p["bytes"], default=None)
                fewest = f": the fewest bytes, {_label(smallest)}, hold {smallest['bytes']:.1%}" if smallest else ""
                parts.append(f"| {budget:.0%} | (none fits{fewest}) | | | | |")
                continue
            share = f"{100 * best['score'] / full:.0f}%" if full == full and full else ""
            parts.append(f"| {budget:.0%} | {_label(best)} | {best['bytes']:.1%} | {best['score']:.1f} | {share} | "
                         f"{best['n']} |")
        parts.append("\nFrontier (no config is better with fewer bytes; n: samples per task, fewer than the full "
                     "cache's: a noisy point):\n")
        parts.append("| config | bytes | score | n per task |")
        parts.append("|---|---|---|---|")
        for p in cell:
            if p["frontier"]:
                parts.append(f"| {_label(p)} | {p['bytes']:.1%} | {p['score']:.1f} | {p['n']} |")
        parts.append("")
    return "\n".join(parts)


def _span(counts) -> str:
    """'20', or '10-20' when the cells drawn differ in their number of samples."""
    counts = sorted(set(counts))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def plot_accuracy_per_byte(summary: list[dict], path, mode: str, budgets=BYTE_BUDGETS) -> None:
    """Average score vs bytes held (fraction of the full cache), one point per config, the frontier drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in accuracy_per_byte(summary) if p["mode"] == mode]
    lengths = sorted({p["length"] for p in points}, key=lambda x: (x is None, x))
    fig, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.6), squeeze=False)
    families = sorted({p["policy"].split(":")[0] for p in points})
    markers = "osD^vP*Xh<>p"
    for ax, length in zip(axes.flat, lengths):
        cell = [p for p in points if p["length"] == length]
        for i, family in enumerate(families):
            pts = [p for p in cell if p["policy"].split(":")[0] == family]
            if pts:
                ax.scatter([100 * p["bytes"] for p in pts], [p["score"] for p in pts], s=22, label=family,
                           marker=markers[i % len(markers)], color="black" if family == "none" else f"C{i % 10}")
        full = next((p for p in cell if p["policy"] == "none"), None)
        if full is not None:  # the reference every ratio is to, across the plot
            ax.axhline(full["score"], color="black", linestyle="--", linewidth=0.8,
                       label=f"full cache ({full['score']:.1f})")
        front = sorted((p for p in cell if p["frontier"]), key=lambda p: p["bytes"])
        ax.step([100 * p["bytes"] for p in front], [p["score"] for p in front], where="post", color="grey",
                linewidth=1, alpha=0.7)
        for p in front:
            label = p["policy"] if p["ratio"] == 0 else f"{p['policy']} {p['ratio']:.2f}"
            ax.annotate(label, (100 * p["bytes"], p["score"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        for budget in budgets:
            ax.axvline(100 * budget, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks([2, 5, 10, 25, 50, 100], ["2%", "5%", "10%", "25%", "50%", "100%"])
        ax.set_xlabel("bytes held after prefill (% of the full cache, log scale)", fontsize=8)
        ax.set_ylabel("average score", fontsize=8)
        ax.set_title(f"{mode}, {length} tokens; n = {_span(p['n'] for p in cell)} samples per task", fontsize=9)
        ax.tick_params(labelsize=7)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        counts = set()  # samples per cell drawn in this panel
        for p_i, policy in enumerate(policies):
            for l_i, length in enumerate(lengths):
                points = defaultdict(list)
                for s in cells:
                    if s["policy"] == policy and s["length"] == length and panel in ("average", s["task"]):
                        points[s["ratio"]].append(s["score"])
                        counts.add(s["n"])
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
        ax.set_title(f"{panel} (n = {_span(counts)})" if counts else panel, fontsize=9)
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


def write_all(out_dir, plots: bool = True) -> list[Path]:
    """summary.csv, summary.md, and (plots) accuracy_vs_ratio_<mode>.png, accuracy_vs_bytes_<mode>.png and
    needle_heatmap_<mode>.png for needle rows."""
    out_dir = Path(out_dir)
    rows = read_rows(out_dir)
    if not rows:
        return []
    summary = summarize(rows)
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    write_csv(summary, written[0])
    _atomic(written[1], lambda f: f.write(markdown(summary) + "\n" + frontier_markdown(summary)))
    for mode in sorted({s["mode"] for s in summary}) if plots else []:
        path = out_dir / f"accuracy_vs_ratio_{mode}.png"
        plot_accuracy(summary, path, mode)
        written.append(path)
        if any(s["policy"] == "none" for s in summary if s["mode"] == mode):
            path = out_dir / f"accuracy_vs_bytes_{mode}.png"
            plot_accuracy_per_byte(summary, path, mode)
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
