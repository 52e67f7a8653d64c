"""The README in the vLLM environment (vLLM's CPU build pins an older transformers, 5.19): its vLLM block runs as
written, and so do its other Python blocks (the oldest transformers kvpress allows)."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from test_readme import PYTHON, vllm_blocks  # noqa: E402


def test_the_vllm_block_runs_as_a_script(tmp_path):
    """Saved as a file and run as a user runs it: vLLM's engine in a process of its own (spawned)."""
    (block,) = vllm_blocks()
    script = tmp_path / "readme_vllm.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # the block's two last prints: "<cached tokens> <answer>" (vLLM's own log lines go to stdout too)
    counts = [line.split(" ", 1)[0] for line in run.stdout.splitlines() if line.split(" ", 1)[0].isdigit()]
    assert counts[-2:][0] == "0" and int(counts[-1]) > 0  # the second question was handed the compressed document


def test_models_are_prepared_from_the_main_environment(tmp_path):
    """.venv-vllm has no gguf: converting a model there says where to do it, before any download."""
    env = {**os.environ, "KVPRESS_MODELS_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "kvpress.models", "smollm2"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0 and "make models" in run.stderr and not any(tmp_path.iterdir())


def test_the_other_blocks_run_on_the_older_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated argument name would say so here
        for i, block in enumerate(b for b in PYTHON if "from vllm" not in b):
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert (tmp_path / "doc.kvpress").is_file()
