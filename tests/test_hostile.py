"""The probes of issue 30 kept as tests: one per defect a hostile user found (bad arguments, other entry points,
threads, rollback, autograd, speculation, transformers features kvpress cannot serve). Each checks the outcome
(tokens, bytes, kept sets, a clear ValueError raised before anything changed), never a timing."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress import KVPressCache

from conftest import greedy, tiny_model
from test_errors import untouched

ROOT = Path(__file__).resolve().parents[1]


def prompt(n=40, batch=1, seed=0):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


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


# ---------------------------------------------------------------------------- 3: parameters silently ignored
@pytest.mark.parametrize("params,match", [
    (dict(budget=30, window=8), r"budget=30 also sets the capacity besides n_sink \+ window = 4 \+ 8"),
    (dict(compression_ratio=0.5, window=8), r"compression_ratio=0.5 also sets the capacity"),
    (dict(budget=30, window=-5), r"window=-5; allowed values: None or an int >= 1"),
    (dict(window=-5), r"window=-5; allowed values: None or an int >= 1"),
    (dict(compression_ratio=0.5, pyramid_beta=math.nan, budget_allocation="pyramid"),
     r"pyramid_beta=nan; allowed values: a finite number"),
])
def test_streaming_llm_window_and_nan_parameters_are_refused(params, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, "streaming_llm", **params)
    assert untouched(model)
    with pytest.raises(ValueError, match=r"epsilon=nan; allowed values: a finite number"):
        kvpress.patch_model(model, "expected_attention", compression_ratio=0.5, epsilon=math.nan)
    assert untouched(model)


def test_streaming_llm_window_sets_the_capacity():
    model = tiny_model("llama")
    with kvpress.patch_model(model, "streaming_llm", n_sink=4, window=8):
        cache = KVPressCache(model.config)
        with torch.no_grad():
            model(prompt(40), past_key_values=cache)
    for _, layer in cache.kvpress_layers():
        assert layer.tokens_per_head().tolist() == [[12, 12]]
        assert layer.key_positions().sort(dim=-1).values[0, 0].tolist() == [0, 1, 2, 3, *range(32, 40)]


# ---------------------------------------------------------------------------- 14: errors from inside
@pytest.mark.parametrize("kwargs,match", [
    (dict(draft="quest", foo=1), r"quest: unknown parameter\(s\) \['foo'\]; allowed parameters"),
    (dict(draft="quest", budget=8), r"budget=8: the draft's budget is draft_budget"),
    (dict(draft="quant4", bits=4), r"bits=4: draft='quant4' stores 8-bit codes"),
    (dict(draft="quant4", window=3), r"kivi: unknown parameter\(s\) \['window'\]"),
])
def test_speculative_draft_parameters_are_checked_before_anything(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        kvpress.speculative_generate(model, prompt(40), max_new_tokens=4, **kwargs)
    assert untouched(model)


def test_kvzip_tokenizer_of_the_wrong_kind_is_a_value_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"kvzip: tokenizer='x' has no encode"):
        kvpress.patch_model(model, "kvzip", compression_ratio=0.5, tokenizer="x")
    assert untouched(model)


def test_speculation_on_a_prompt_shorter_than_the_default_draft_budget():
    """The default draft budget (10% of the prompt, at least 64) is capped at the prompt: a 30-token prompt is
    drafted from all of it, and the output is plain greedy's."""
    model = tiny_model("llama")
    ids = prompt(30)
    expected = greedy(model, ids, 10)
    assert torch.equal(kvpress.speculative_generate(model, ids, max_new_tokens=10, eos_token_id=[]), expected)
