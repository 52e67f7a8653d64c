"""The README in the vLLM environment (vLLM's CPU build pins an older transformers, 5.19): its vLLM block runs as
written, and so do its other Python blocks (the oldest transformers kvpress allows)."""

import gc
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from test_readme import PYTHON, vllm_blocks  # noqa: E402


def test_the_vllm_block_runs_as_written():
    (block,) = vllm_blocks()
    namespace: dict = {}
    exec(compile(block, "README.md vLLM block", "exec"), namespace)
    outputs = namespace["outputs"]
    assert len(outputs) == 1 and outputs[0].outputs[0].token_ids
    namespace["llm"].llm_engine.engine_core.shutdown()
    namespace.clear()
    gc.collect()


def test_the_other_blocks_run_on_the_older_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated argument name would say so here
        for i, block in enumerate(b for b in PYTHON if "from vllm" not in b):
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert (tmp_path / "doc.kvpress").is_file()
