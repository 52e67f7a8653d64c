"""Tensor parallelism (transformers' tp_plan over 2 gloo processes on CPU): every policy family gives the tokens
it gives on one process; policies that decide over several heads get the other rank's evidence, and the others
perform no collective."""

import json
import os
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
CROSS_HEAD = {"snapkv adaptive", "tova", "expected_attention adaptive", "kvzip global", "kvzap global", "token_select",
              "recycled_attention"}
# torchrun started from the interpreter running the suite (not whatever `torchrun` is on PATH, if any): the
# multi-process tests run wherever the suite runs, e.g. a virtual environment's python that is not activated
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _run(command):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_tensor_parallel_tokens_equal_one_process(arch, tmp_path):
    from kvpress.calibration import calibrate
    from kvpress.formats.calibration import FILE_NAME
    from conftest import TOK

    torch.manual_seed(0)
    model = MODELS[arch]()
    model.save_pretrained(tmp_path)
    # beside the weights, for the calibrated policies (commvq's codebooks: each rank reads its heads' tables)
    calibrate(model, TOK, n_texts=3, n_tokens=120, held_out=1, tokens_per_text=80, codebook_stages=2,
              log=lambda *a: None).save(tmp_path / FILE_NAME)
    alone = _run([sys.executable, str(WORKER), str(tmp_path)])
    split = _run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(29500 + len(arch)), str(WORKER),
                  str(tmp_path)])
    assert {k: v["tokens"] for k, v in split.items()} == {k: v["tokens"] for k, v in alone.items()}
    assert all(v["collectives"] == 0 for v in alone.values())  # one process: never a collective
    for label, row in split.items():  # two: only the policies that decide over several heads
        assert (row["collectives"] > 0) == (label in CROSS_HEAD), label


def test_evals_under_torchrun_write_the_one_process_rows(tmp_path):
    """kvpress-eval under torchrun, both ways: samples split over ranks (data parallel) and one model split over
    ranks (--tensor-parallel): the rows equal one process's (timings aside)."""
    from transformers import AutoTokenizer

    from evals.report import read_rows
    from kvpress.models import model_path

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = ["--model", str(model_dir), "--max-new-tokens", "4", "--task", "ruler", "--subtasks", "niah_single_1",
            "--lengths", "256", "--samples", "2", "--policies", "none,tova,snapkv:budget_allocation=adaptive",
            "--ratios", "0.5", "--modes", "query_agnostic", "--no-progress", "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def rows(out, launcher, *extra):
        done = subprocess.run([*launcher, "-m", "evals.cli", *args, *extra, "--out", str(out)], capture_output=True,
                              text=True, env=env, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        return sorted((r["task"], r["index"], r["policy"], r["ratio"], r["prediction"], r["kv_bytes"])
                      for r in read_rows(out))

    alone = rows(tmp_path / "alone", [sys.executable])
    torchrun = [*TORCHRUN, "--nproc_per_node", "2", "--master_port", "29531"]
    assert rows(tmp_path / "data", torchrun) == alone
    # one model over both ranks: each rank's cache holds its heads; kv_bytes are rank 0's: half of every layer
    # for per-head budgets (adaptive budgets give rank 0's heads their share of the layer-wide top-k instead)
    split = rows(tmp_path / "tp", torchrun, "--tensor-parallel")
    assert [r[:5] for r in split] == [r[:5] for r in alone]
    assert all(a[5] == 2 * b[5] for a, b in zip(alone, split) if "adaptive" not in a[2])


@pytest.mark.parametrize("policy,params", [("snapkv", dict(compression_ratio=0.5)), ("tova", dict(compression_ratio=0.5)),
                                           ("kivi", dict(bits=4, group_size=16, residual_length=16))])
def test_device_map_with_an_offloaded_layer_gives_the_same_tokens(policy, params, tmp_path):
    """accelerate's layer-wise placement (here: layer 1 offloaded to disk, its weights brought in per forward):
    the cache layers follow their layer's tensors, nothing assumes one device."""
    import kvpress

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 120, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    whole = LlamaForCausalLM.from_pretrained(tmp_path / "model").eval()
    placed = LlamaForCausalLM.from_pretrained(
        tmp_path / "model", offload_folder=tmp_path / "offload",
        device_map={"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                    "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}).eval()
    out = []
    for model in (whole, placed):
        with kvpress.patch_model(model, policy, **params):
            out.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False).tolist())
    assert out[0] == out[1]
