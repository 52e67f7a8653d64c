"""benchmarks/gpu_suite.py off the GPU: its CPU dry run (section 2, tiny shapes, Triton interpreted) runs every
kernel against its reference and writes results.json + summary.md; without CUDA anything else is refused."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def _suite(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=SCRIPT.parents[1])


def test_cpu_dry_run_checks_every_kernel_against_its_reference(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "suite"
    proc = _suite("--cpu-dry-run", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    section = json.loads((out / "results.json").read_text())["sections"]["kernels"]
    assert section["status"] == "complete"
    rows = section["tables"]["per kernel"]["rows"]
    kernels = {row["kernel"] for row in rows}
    assert {"sparse (triton)", "flat runs (triton)"} <= kernels
    assert any(k.startswith("kivi-") and "triton" in k for k in kernels)
    assert any("torch" in k for k in kernels)
    assert all(row["failed"] == 0 and row["mismatches"] == 0 for row in rows), rows
    assert "| kernel |" in (out / "summary.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_suite_refuses_in_one_line(tmp_path):
    proc = _suite("--quick", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_captured_decode_section_runs_on_cpu():
    """Section 7's measurement off the GPU (eager backend, tiny model): StaticCache and kvpress configs with a reserve
    decode through one compiled graph each and report their bytes."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_sections.capture import captured_decode
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    codec = dict(bits=4, group_size=16, residual_length=16)
    for policy, params in [(None, {}), ("none", {}), ("snapkv+kivi", dict(compression_ratio=0.5, **codec))]:
        with warnings.catch_warnings():  # the section passes past_key_values=: the GPU image's transformers (5.17)
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            out = captured_decode(model, policy, params, ids, steps=4, warmup=2, backend="eager")
        assert out["step_ms"] > 0 and out["kv_bytes"] > 0
