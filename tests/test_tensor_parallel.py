"""Tensor parallelism (transformers' tp_plan over 2 gloo processes on CPU): every policy family gives the tokens
it gives on one process; policies that decide over several heads get the other rank's evidence, and the others
perform no collective."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

WORKER = Path(__file__).parent / "helpers" / "tp_worker.py"
ROOT = Path(__file__).resolve().parents[1]
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
          "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16))}
CROSS_HEAD = {"snapkv adaptive", "tova", "expected_attention adaptive", "kvzip global"}


def _run(command):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_tensor_parallel_tokens_equal_one_process(arch, tmp_path):
    torch.manual_seed(0)
    MODELS[arch]().save_pretrained(tmp_path)
    alone = _run([sys.executable, str(WORKER), str(tmp_path)])
    split = _run(["torchrun", "--nproc_per_node", "2", "--master_port", str(29500 + len(arch)), str(WORKER),
                  str(tmp_path)])
    assert {k: v["tokens"] for k, v in split.items()} == {k: v["tokens"] for k, v in alone.items()}
    assert all(v["collectives"] == 0 for v in alone.values())  # one process: never a collective
    for label, row in split.items():  # two: only the policies that decide over several heads
        assert (row["collectives"] > 0) == (label in CROSS_HEAD), label
