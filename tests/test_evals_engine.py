"""The shared prefill + batched decode of evals/engine.py gives, for every (policy, ratio), exactly what a plain
patched model gives for that config alone: the same kept slots after prefill and the same greedy tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpress
from evals.engine import Rows, answer, configs_for, decode_batches, prefill

POLICIES = ["none", "snapkv", "knorm", "random", "h2o", "tova", "streaming_llm", "kivi", "snapkv+kivi", "kvzip",
            "kvzip:budget_allocation=uniform", "expected_attention", "keydiff", "kvzip+kivi", "h2o:slack=3", "laq", "laq+kivi"]


class _CharTokenizer:  # tiny models have no tokenizer: kvzip's replay prompt comes from this one
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 120 for c in text]


@pytest.fixture(autouse=True)
def _kvzip_tokenizer(monkeypatch):
    from kvpress.policies import kvzip
    monkeypatch.setattr(kvzip, "_load_tokenizer", lambda model: _CharTokenizer())


def _model(kv_heads: int = 1):
    torch.manual_seed(0)
    # head_dim 32 so that KIVI's default group size fits; no EOS, so every config decodes every step
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _alone(model, config, ids, question, n):
    with kvpress.patch_model(model, config.make()):
        cache = kvpress.KVPressCache(model.config)
        full = ids
        if question is not None:  # query-agnostic: compress the context, then extend with the question
            with torch.no_grad():
                model(input_ids=ids, cache=cache)
            full = torch.cat([ids, question], 1)
        out = model.generate(full, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=n,
                             do_sample=False)
    return out[0, full.shape[1]:].tolist()


@pytest.mark.parametrize("mode", ["query_aware", "query_agnostic"])
def test_each_config_matches_its_own_patched_generate(mode):
    model = _model(kv_heads=2)  # two KV heads, so that KVzip's global budget gives heads different counts
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (1, 230))
    question = None if mode == "query_aware" else torch.randint(3, 128, (1, 9))
    configs = configs_for(POLICIES, [0.6])
    pre = prefill(model, ids, configs)
    batches = decode_batches(pre, configs)
    # prefill-only policies ride together under "none", decode-time evictors under Rows, low-bit ones alone
    kinds = {(type(policy).__name__, tuple(sorted({c.policy for c in batch}))) for batch, policy in batches}
    assert ("NoCompression", ("expected_attention", "keydiff", "knorm", "kvzip:budget_allocation=uniform", "laq",
                              "none", "random", "snapkv")) in kinds
    assert ("NoCompression", ("kvzip",)) in kinds  # flat per-head runs: a batch of their own
    assert ("Rows", ("h2o", "streaming_llm", "tova")) in kinds
    assert ("H2O", ("h2o:slack=3",)) in kinds  # evicts on its own schedule: alone, under its own policy
    assert sum(1 for batch, _ in batches if len(batch) == 1 and "kivi" in batch[0].policy) == 4
    for batch, policy in batches:
        tokens, _ = answer(model, pre, batch, policy, question, 8, set())
        for config, got in zip(batch, tokens):
            assert got == _alone(model, config, ids, question, 8), config


def test_kept_slots_after_prefill_match_a_plain_prefill():
    model = _model()
    ids = torch.randint(3, 128, (1, 230), generator=torch.Generator().manual_seed(2))
    configs = configs_for(["snapkv", "h2o", "tova", "streaming_llm", "knorm"], [0.3, 0.9])
    pre = prefill(model, ids, configs)
    _assert_same_as_plain_prefill(model, ids, pre, configs)


def _assert_same_as_plain_prefill(model, ids, pre, configs):
    """Each config's cache from the shared prefill holds exactly what a plain patched prefill keeps."""
    for config in configs:
        cache = kvpress.KVPressCache(model.config)
        with kvpress.patch_model(model, config.make()), torch.no_grad():
            model(input_ids=ids, cache=cache)
        for mine, ref in zip(pre.caches[config].layers, cache.layers):
            assert torch.equal(mine.key_positions(), ref.key_positions()), config
            assert torch.equal(mine.key_valid(), ref.key_valid()), config
            assert torch.equal(mine.keys_view(), ref.keys_view()), config
            assert torch.equal(mine.values_view(), ref.values_view()), config
        assert pre.caches[config].nbytes() == cache.nbytes()


def test_rows_rejects_two_parameter_sets_of_one_policy():
    h2o = kvpress.policies.resolve_policy("h2o", compression_ratio=0.5)
    with pytest.raises(AssertionError):
        Rows([h2o, kvpress.policies.resolve_policy("h2o", compression_ratio=0.5, recent=3)])


def test_policy_specs_with_allocators_match_their_own_patched_runs():
    """"name:key=value" specs reach the policy; pyramid budgets and adaptive (ragged) heads come out of the shared
    prefill exactly as from a plain patched prefill, and decode the same tokens."""
    model = _model(kv_heads=2)
    ids = torch.randint(3, 128, (1, 230), generator=torch.Generator().manual_seed(3))
    configs = configs_for(["snapkv:budget_allocation=adaptive:window_size=8", "h2o:budget_allocation=pyramid",
                           "snapkv:budget_allocation=pyramid"], [0.6])
    assert configs[0].make().budget_allocation == "adaptive" and configs[0].make().window_size == 8
    pre = prefill(model, ids, configs)
    _assert_same_as_plain_prefill(model, ids, pre, configs)
    assert any(layer.is_flat for layer in pre.caches[configs[0]].layers)
    for batch, policy in decode_batches(pre, configs):
        tokens, _ = answer(model, pre, batch, policy, None, 6, set())
        for config, got in zip(batch, tokens):
            assert got == _alone(model, config, ids, None, 6), config


def test_rows_that_stop_leave_the_batch_and_the_others_go_on_unchanged():
    model = _model()
    ids = torch.randint(3, 128, (1, 230), generator=torch.Generator().manual_seed(3))
    configs = configs_for(["h2o", "tova", "streaming_llm"], [0.3, 0.6])
    pre = prefill(model, ids, configs)
    alone = {c: _alone(model, c, ids, None, 10) for c in configs}
    # a stop token that one config emits early while another never does: rows leave the batch mid-decode
    stop = next({t} for c in configs for t in alone[c][:3] if any(t not in alone[d] for d in configs))
    [(batch, policy)] = decode_batches(pre, configs)
    assert isinstance(policy, Rows)
    tokens, _ = answer(model, pre, batch, policy, None, 10, stop)
    cut = {c: next((alone[c][:i + 1] for i, t in enumerate(alone[c]) if t in stop), alone[c]) for c in configs}
    assert {len(cut[c]) for c in configs} != {10} and 10 in {len(cut[c]) for c in configs}
    for config, got in zip(batch, tokens):
        assert got == cut[config], config


def test_flat_configs_stacked_as_rows_decode_like_each_alone():
    """Several flat-layout configs (per-head budgets) in one batch: their runs are concatenated, not padded."""
    model = _model(kv_heads=2)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    configs = configs_for(["kvzip", "snapkv:budget_allocation=adaptive:window_size=8"], [0.4, 0.7])
    pre = prefill(model, ids, configs)
    batches = decode_batches(pre, configs)
    assert [len(batch) for batch, _ in batches] == [4]
    for batch, policy in batches:
        for mode_question in (None, torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))):
            tokens, _ = answer(model, pre, batch, policy, mode_question, 6, set())
            for config, got in zip(batch, tokens):
                assert got == _alone(model, config, ids, mode_question, 6), config
