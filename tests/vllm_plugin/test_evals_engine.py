"""kvpress-eval --engine vllm: the transformers path's samples and rows, answered by vLLM serving kvpress."""

import pytest

from evals import cli
from evals.report import read_rows
from kvpress.integrations.prompts import evicted_tokens
from kvpress.policies import resolve_policy

ARGS = ["--model", "smollm2", "--task", "ruler", "--subtasks", "niah_single_1,niah_multikey_1", "--lengths", "1024",
        "--n", "2", "--max-new-tokens", "12", "--policies", "none,snapkv", "--ratios", "0.75", "--no-progress"]


def run(*argv):
    return cli.run(cli.build_parser().parse_args(list(argv)))


def test_the_engine_answers_the_same_samples_and_writes_the_same_rows(tmp_path):
    hf, engine = tmp_path / "hf", tmp_path / "vllm"
    run(*ARGS, "--out", str(hf))
    counts = run(*ARGS, "--out", str(engine), "--engine", "vllm")
    assert counts["evaluated"] == 8 and (engine / "summary.md").exists()
    ours = {(r["task"], r["index"], r["policy"]): r for r in read_rows(engine)}
    theirs = {(r["task"], r["index"], r["policy"]): r for r in read_rows(hf)}
    assert ours.keys() == theirs.keys()
    snapkv = resolve_policy("snapkv", compression_ratio=0.75)
    token_bytes = 2 * 30 * 3 * 64 * 4  # SmolLM2 fp32: K and V, 30 layers, 3 KV heads of 64
    for key, row in ours.items():
        other = theirs[key]
        assert set(row) - {"engine", "page_tokens", "cached_tokens"} == set(other) and row["n_tokens"] == other["n_tokens"]
        assert row["engine"] == "vllm" and row["page_tokens"] == 128  # vLLM's default block size on CPU
        if row["policy"] == "none":  # exact on both paths: the same answer, the same bytes
            assert row["prediction"] == other["prediction"] and row["kv_bytes"] == other["kv_bytes"]
        else:  # the engine keeps the budget raised to whole pages of 128 tokens
            kept = row["n_tokens"] - evicted_tokens(snapkv, row["n_tokens"], 128)
            assert row["kv_bytes"] == kept * token_bytes >= other["kv_bytes"]
            assert row["cache_bytes"] == (-(-row["n_tokens"] // 128) - (row["n_tokens"] - kept) // 128) * 128 * token_bytes
    assert run(*ARGS, "--out", str(engine), "--engine", "vllm")["evaluated"] == 0  # a rerun resumes


def test_query_agnostic_runs_through_the_declared_context(tmp_path):
    """Each request declares its sample's context: the engine compresses it where it ends (whole pages), without
    the question. The rows are the transformers path's; `none` answers alike."""
    hf, engine = tmp_path / "hf", tmp_path / "vllm"
    args = [*ARGS, "--modes", "query_agnostic"]
    run(*args, "--out", str(hf))
    assert run(*args, "--out", str(engine), "--engine", "vllm")["evaluated"] == 8
    ours = {(r["task"], r["index"], r["policy"]): r for r in read_rows(engine)}
    theirs = {(r["task"], r["index"], r["policy"]): r for r in read_rows(hf)}
    assert ours.keys() == theirs.keys()
    for key, row in ours.items():
        other = theirs[key]
        assert row["mode"] == other["mode"] == "query_agnostic" and row["n_tokens"] == other["n_tokens"]
        if row["policy"] == "none":
            assert row["prediction"] == other["prediction"] and row["kv_bytes"] == other["kv_bytes"]
        else:  # the context compressed at its end, to whole pages (at least the transformers path's budget)
            full = ours[(key[0], key[1], "none")]["kv_bytes"]
            assert other["kv_bytes"] <= row["kv_bytes"] < full
