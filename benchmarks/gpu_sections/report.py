"""results.json + summary.md, rewritten after every row, and running one section into them."""

from __future__ import annotations

import json
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path


from .common import Deadline, TimeLimit, free_memory, measured_copy_bandwidth


class Report:
    """results.json + summary.md in one folder; sections already there from an earlier run are kept."""

    def __init__(self, out: Path, system: dict, args: dict):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.json"
        try:
            old = json.loads(self.path.read_text()) if self.path.exists() else {}
        except ValueError:  # a file cut short by a killed run: start over
            old = {}
        self.data = dict(suite="kvpress benchmarks/gpu_suite.py", system=system, args=args,
                         sections=old.get("sections", {}))

    def section(self, key: str, title: str) -> dict:
        sec = dict(title=title, status="running", started_utc=datetime.now(timezone.utc).strftime("%H:%M:%S"),
                   device=self.data["system"].get("gpu") or "cpu", notes=[], tables={})
        self.data["sections"][key] = sec
        return sec

    def table(self, sec: dict, name: str, columns: list[tuple[str, str]]) -> list:
        sec["tables"][name] = dict(columns=columns, rows=[])
        return sec["tables"][name]["rows"]

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "summary.md").write_text(self.markdown())

    def markdown(self) -> str:
        s = self.data["system"]
        lines = ["# kvpress GPU suite", "",
                 f"{s.get('date_utc')} UTC, host {s.get('host')}. Device: **{s.get('gpu') or 'CPU (dry run)'}**"
                 + (f", {s.get('gpu_memory_gib')} GiB, {s.get('multiprocessors')} SMs" if s.get("gpu") else ""),
                 f"nvidia-smi: {s.get('nvidia_smi')} | CUDA runtime {s.get('cuda_runtime')} | torch {s['torch']} | "
                 f"triton {s['triton']} | transformers {s['transformers']} | kvpress {s['kvpress']} "
                 f"(git {s.get('kvpress_git')}) | python {s['python']}", ""]
        if measured_copy_bandwidth():
            lines += [f"Measured device copy bandwidth: {measured_copy_bandwidth() / 1e9:,.0f} GB/s (2 x bytes / time, 1 GiB).", ""]
        order = ["kernels", "speed", "e2e", "long", "spec"]
        for key in sorted(self.data["sections"], key=lambda k: order.index(k) if k in order else 99):
            sec = self.data["sections"][key]
            lines += [f"## {sec['title']}", "", f"Status: {sec['status']} ({sec.get('seconds', '?')} s, "
                      f"device {sec.get('device')}).", ""]
            lines += [f"- {note}" for note in sec["notes"]] + ([""] if sec["notes"] else [])
            for name, tab in sec["tables"].items():
                lines += [f"**{name}**", "", _md_table(tab["columns"], tab["rows"]), ""]
        return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) >= 1e-3 else f"{value:.2e}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "/")


def _md_table(columns, rows) -> str:
    if not rows:
        return "(no rows)"
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule] + body)


def run_section(report, key, title, fn, args, device):
    sec = report.section(key, title)
    report.write()
    start = time.monotonic()
    deadline = Deadline(args.time_limit)
    try:
        fn(args, device, report, sec, deadline)
        sec["status"] = "complete"
    except TimeLimit:
        sec["status"] = f"stopped at the time limit ({args.time_limit:.0f} s): rows after the last one were not run"
    except Exception as e:
        traceback.print_exc()
        sec["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    sec["seconds"] = round(time.monotonic() - start, 1)
    free_memory()
    report.write()
    print(f"[gpu_suite] {key}: {sec['status']} ({sec['seconds']} s)", flush=True)
