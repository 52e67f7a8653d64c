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


# ---------------------------------------------------------------------------- values that passed checks, then failed
@pytest.mark.parametrize("policy,params,field", [
    ("h2o", dict(compression_ratio=0.5, slack=10 ** 12), "slack"),  # an allocation of 128 GB at the first cut
    ("quest", dict(budget=16, page_size=10 ** 12), "page_size"),
    ("lserve", dict(budget=32, page_size=10 ** 9), "page_size"),
    ("retrieval", dict(budget=16, chunk_size=10 ** 9), "chunk_size"),
    ("shadowkv", dict(budget=16, chunk_size=10 ** 9), "chunk_size"),
    ("expected_attention", dict(compression_ratio=0.5, n_future_positions=10 ** 9), "n_future_positions"),
    ("laq", dict(compression_ratio=0.5, lookahead=10 ** 9), "lookahead"),  # ran for ever
])
def test_token_counts_beyond_the_models_context_are_refused(policy, params, field):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"{policy}: {field}=\d+ is more tokens than the model reads "
                                         rf"\(max_position_embeddings=1024\); allowed values: at most 1024"):
        kvpress.patch_model(model, policy, **params)
    assert untouched(model)


def test_an_unwritable_offload_dir_is_refused_at_patch_time():
    """It was accepted, and generate failed once the prompt was stored."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"shadowkv: offload_dir='/proc': no file can be written"):
        kvpress.patch_model(model, "shadowkv", budget=16, offload_dir="/proc")
    assert untouched(model)


def test_hip_on_a_prompt_shorter_than_its_sinks_reads_it_whole():
    """IndexError before: the searched range started past the prompt."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    with kvpress.patch_model(model, "hip", budget=24, n_sink=8, window=4, block_size=2):
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("bad,match", [
    (lambda ids: dict(input_ids=ids[0]), r"input_ids: \(40,\) torch.int64; allowed values: integer token ids"),
    (lambda ids: dict(input_ids=ids.float()), r"input_ids: \(1, 40\) torch.float32"),
    (lambda ids: dict(input_ids=ids[:, :0]), r"input_ids: \(1, 0\)"),
    (lambda ids: dict(input_ids=ids, attention_mask=torch.ones(1, 39)), r"attention_mask: \(1, 39\)"),
    (lambda ids: dict(input_ids=ids, do_sample="yes"), r"do_sample='yes'; allowed values: True or False"),
])
def test_speculative_generate_refuses_ids_it_cannot_run(bad, match):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=match):
        kvpress.speculative_generate(model, max_new_tokens=3, **bad(ids))
    assert untouched(model)


@pytest.mark.parametrize("kwargs,match", [(dict(draft_tokens=True), r"draft_tokens=True"),
                                          (dict(context_ids="float"), r"context_ids: \(1, 40\)")])
def test_rapid_generate_refuses_bools_and_float_ids(kwargs, match):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    if kwargs.get("context_ids") == "float":
        kwargs = dict(context_ids=ids.float())
    args = {**dict(context_ids=ids, question_ids=ids[:, :5], max_new_tokens=3), **kwargs}
    with pytest.raises(ValueError, match=match):
        kvpress.speculative.rapid_generate(model, args.pop("context_ids"), args.pop("question_ids"), **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(context=""), r"context=''; allowed values: a non-empty string"),
    (dict(context=None), r"context=None"),
    (dict(context=["a document"]), r"context=\['a document'\]"),
    (dict(chat_template="yes"), r"chat_template='yes'; allowed values: None"),
    (dict(tokenizer=None), r"tokenizer=None; allowed values: the model's tokenizer"),
    (dict(tokenizer="gpt2"), r"tokenizer='gpt2'"),
])
def test_compress_names_the_argument_that_is_wrong(kwargs, match):
    """Each was reported as a missing compression ratio (or an AttributeError)."""
    from test_compressed import CONTEXT, TOK
    model = tiny_model("llama")
    args = {**dict(tokenizer=TOK, context=CONTEXT), **kwargs}
    with pytest.raises(ValueError, match=match):
        kvpress.compress(model, args.pop("tokenizer"), args.pop("context"), **args)
    assert untouched(model)


@pytest.mark.parametrize("tokenizer", [None, "gpt2", 42])
def test_ask_with_what_is_not_a_tokenizer_is_a_value_error(tokenizer):
    from test_compressed import CONTEXT, TOK
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, "snapkv", compression_ratio=0.5)
    with pytest.raises(ValueError, match=r"tokenizer=.*; allowed values: the model's tokenizer"):
        compressed.ask(tokenizer, "Who?")
    assert untouched(model)
