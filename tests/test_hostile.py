"""The probes of issue 30 kept as tests: one per defect a hostile user found (bad arguments, other entry points,
threads, rollback, autograd, speculation, transformers features kvpress cannot serve). Each checks the outcome
(tokens, bytes, kept sets, a clear ValueError raised before anything changed), never a timing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- 18: multi-process tests
def test_multi_process_tests_run_without_torchrun_on_path(tmp_path):
    """A virtual environment's python run without activating it has no `torchrun` on PATH: the tensor-parallel
    tests start their processes from the running interpreter, so none of them skips (setup alone decides)."""
    env = dict(os.environ, PATH=str(tmp_path))  # no torchrun (nor anything else) on PATH
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--setup-only", "-rs",
                           "tests/test_tensor_parallel.py"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" not in done.stdout, done.stdout[-3000:]
