"""Bad input fails before anything changes, with a message naming the parameter and the allowed values."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

import kvpress
from kvpress.policies import H2O, SnapKV, StreamingLLM

from conftest import tiny_model


def untouched(model, attn="sdpa"):
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation == attn and "generate" not in model.__dict__ and hooks == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="snapkvv"), r"policy='snapkvv' is unknown; allowed values: \[.*'h2o', .*'none', .*'snapkv'"),
    (dict(policy="snapkv", compression_ratio=1.0), r"compression_ratio=1.0 is outside the allowed range \[0, 1\)"),
    (dict(policy="snapkv", compression_ratio=-0.1), r"compression_ratio=-0.1 is outside the allowed range \[0, 1\)"),
    (dict(policy="h2o"), r"give exactly one of compression_ratio .* or budget"),
    (dict(policy="snapkv", compression_ratio=0.5, budget=10), r"give exactly one of compression_ratio"),
    (dict(policy="snapkv", budget=0), r"budget=0; allowed values: an int >= 1"),
    (dict(policy="streaming_llm", budget=10, n_sink=4, window=8), r"budget=10 is smaller than n_sink \+ window = 4 \+ 8"),
    (dict(policy="h2o", budget=8, recent=16), r"budget=8 is smaller than recent=16"),
    (dict(policy="snapkv", budget=16, window_size=32), r"budget=16 is smaller than window_size=32"),
    (dict(policy="snapkv", compression_ratio=0.5, kernel_size=4), r"kernel_size=4; allowed values: an odd int"),
    (dict(policy="snapkv", compression_ratio=0.5, pooling="mean"), r"pooling='mean'; allowed values: 'max', 'avg'"),
    (dict(policy="snapkv", compression_ratio=0.5, windw=3), r"unknown parameter\(s\) \['windw'\]; allowed parameters"),
    (dict(policy=42), r"policy=42; allowed values"),
    (dict(policy="kvzap", compression_ratio=0.5, window=-1), r"kvzap: window=-1; allowed values: an int >= 0"),
])
def test_bad_policy_arguments_leave_model_unpatched(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, **kwargs)
    assert untouched(model)


def test_policy_objects_validate_on_construction():
    with pytest.raises(ValueError, match="compression_ratio=1.5"):
        SnapKV(compression_ratio=1.5)
    with pytest.raises(ValueError, match="n_sink \\+ window"):
        StreamingLLM(budget=6, n_sink=4, window=4)
    with pytest.raises(ValueError, match="recent=9"):
        H2O(budget=8, recent=9)


class _OwnAttention(nn.Module):
    """Attention computed inline, never through transformers' AttentionInterface."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _OwnModel(PreTrainedModel):
    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.attn = _OwnAttention()

    def forward(self, x):
        return self.attn(x)


def test_model_without_attention_interface_is_rejected():
    model = _OwnModel(LlamaConfig(hidden_size=16, num_attention_heads=1))
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match="does not run its attention through transformers' AttentionInterface"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    assert model.config._attn_implementation == impl and "generate" not in model.__dict__


def test_double_patch_is_rejected_and_first_patch_survives():
    model = tiny_model("llama")
    patch = kvpress.patch_model(model, "none")
    with pytest.raises(ValueError, match="already patched"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    assert model.config._attn_implementation == "kvpress_sdpa"
    patch.unpatch()
    assert untouched(model)


def test_unsupported_base_attention_is_rejected():
    model = tiny_model("llama")
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=r"attn_implementation='flex_attention' cannot be wrapped; allowed values"):
        kvpress.patch_model(model, "none")
    assert untouched(model, "flex_attention")


def test_last_cache_stats_before_any_generate_is_a_clear_error():
    with pytest.raises(ValueError, match="no kvpress generate has run"):
        kvpress.last_cache_stats(tiny_model("llama"))


def test_missing_model_says_to_run_make_models(tmp_path, monkeypatch):
    from kvpress.models import load

    monkeypatch.setenv("KVPRESS_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="Run `make models` first"):
        load("smollm2")
    with pytest.raises(ValueError, match=r"model='gpt5' is unknown; allowed values: \['gemma3', 'smollm2'\]"):
        load("gpt5")
