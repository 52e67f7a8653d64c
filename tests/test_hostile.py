"""The probes of issue 30 kept as tests: one per defect a hostile user found (bad arguments, other entry points,
threads, rollback, autograd, speculation, transformers features kvpress cannot serve). Each checks the outcome
(tokens, bytes, kept sets, a clear ValueError raised before anything changed), never a timing."""

import copy
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress import KVPressCache

from conftest import TOK, greedy, record_held_tokens, tiny_model
from test_errors import untouched

ROOT = Path(__file__).resolve().parents[1]


def prompt(n=40, batch=1, seed=0):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def kept(cache):
    """Every kvpress layer's kept positions, per row and head (sorted)."""
    out = []
    for _, layer in cache.kvpress_layers():
        positions, valid = layer.key_positions(), layer.key_valid()
        out.append([[sorted(positions[b, h][valid[b, h]].tolist()) for h in range(positions.shape[1])]
                    for b in range(positions.shape[0])])
    return out


def prefill(call, ids, **kwargs):
    """A fresh cache after one prompt forward `call(ids, cache)` (no autograd)."""
    cache = KVPressCache(kwargs.pop("config"))
    with torch.no_grad():
        call(input_ids=ids, cache=cache, **kwargs)
    return cache


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
            model(prompt(40), cache=cache)
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



# ---------------------------------------------------------------------------- 1, 2: every entry point is served
@pytest.mark.parametrize("policy,params", [("kvzip", dict(compression_ratio=0.75, tokenizer=TOK)),
                                           ("snapkv", dict(compression_ratio=0.5, window_size=4))])
def test_the_inner_model_compresses_like_the_model(policy, params):
    """model.model(...) (NVIDIA kvpress's pipeline calls the decoder) keeps what model(...) keeps, model-level
    policies (KVzip's replay after the prompt) included: before, KVzip kept every token on that path."""
    model = tiny_model("llama")
    ids = prompt(48)
    with kvpress.patch_model(model, policy, **params):
        outer = prefill(model, ids, config=model.config)
        inner = prefill(model.model, ids, config=model.config)
    assert kept(inner) == kept(outer)
    # 48 tokens per KV head at ratio r: kvzip's global budget spreads them over layers and heads
    held = [len(head) for layer in kept(inner) for row in layer for head in row]
    assert sum(held) == (2 * 2 * 12 if policy == "kvzip" else 2 * 2 * 24)


def test_the_inner_model_prefills_in_chunks():
    """With prefill_chunk_size, a prompt fed to the decoder directly is chunked too (it held the whole prompt), and
    keeps what the model's own chunked prefill keeps."""
    model = tiny_model("llama")
    ids = prompt(80)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.75, window_size=4, prefill_chunk_size=16):
        outer = prefill(model, ids, config=model.config)
        with record_held_tokens() as held:
            inner = prefill(model.model, ids, config=model.config)
            hidden = model.model(ids, cache=KVPressCache(model.config)).last_hidden_state
    assert max(held) <= 20 + 16  # budget + one chunk
    assert kept(inner) == kept(outer)
    assert hidden.shape == (1, 80, 64)  # every position's hidden state, as the decoder returns them


def test_kvzip_with_inputs_embeds_is_refused_before_the_cache_changes():
    """KVzip replays the prompt's token ids: embeddings are refused before any layer appends (the cache then held
    the uncompressed prompt, and a retry ran as a continuation, never compressed). The retry with ids compresses."""
    model = tiny_model("llama")
    ids = prompt(48)
    with kvpress.patch_model(model, "kvzip", compression_ratio=0.75, tokenizer=TOK):
        cache = KVPressCache(model.config)
        with pytest.raises(ValueError, match=r"inputs_embeds: kvzip\(.*\) reads the prompt's token ids"):
            model(inputs_embeds=model.model.embed_tokens(ids), cache=cache)
        assert cache.get_seq_length() == 0 and all(not layer.is_initialized for layer in cache.layers)
        with torch.no_grad():
            model(ids, cache=cache)
        assert kept(cache) == kept(prefill(model, ids, config=model.config))


def test_a_prompt_forward_that_fails_leaves_the_cache_empty_and_a_decode_step_leaves_it_refused():
    model = tiny_model("llama")
    ids = prompt(40)
    fail = {"armed": True}

    def second_layer_fails(module, args):
        if fail["armed"]:
            raise RuntimeError("injected")

    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4), torch.no_grad():
        handle = model.model.layers[1].register_forward_pre_hook(second_layer_fails)
        cache = KVPressCache(model.config)
        with pytest.raises(RuntimeError, match="injected"):  # layer 0 appended the prompt, layer 1 never ran
            model(ids, cache=cache)
        assert cache.get_seq_length() == 0 and all(not layer.is_initialized for layer in cache.layers)
        fail["armed"] = False
        model(ids, cache=cache)  # a prompt again: compressed like a fresh cache
        assert kept(cache) == kept(prefill(model, ids, config=model.config))
        fail["armed"] = True
        with pytest.raises(RuntimeError, match="injected"):  # a decode step: layer 0 appended its token
            model(ids[:, :1], cache=cache)
        fail["armed"] = False
        with pytest.raises(ValueError, match=r"cache: a forward on this cache raised .*; allowed values: a new"):
            model(ids[:, :1], cache=cache)
        handle.remove()


# ---------------------------------------------------------------------------- 12, 13: patch / unpatch atomic
def test_the_decoder_of_a_model_can_be_patched_and_unpatched():
    """patch_model(model.model): a model without generate (it raised an AttributeError after switching the
    attention implementation and installing hooks). The model that holds it is then served too."""
    model = tiny_model("llama")
    ids = prompt(40)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4):
        expected = kept(prefill(model, ids, config=model.config))
    reference = model(ids).logits
    with kvpress.patch_model(model.model, "snapkv", compression_ratio=0.5, window_size=4):
        assert kept(prefill(model.model, ids, config=model.config)) == expected
        assert kept(prefill(model, ids, config=model.config)) == expected
        with pytest.raises(ValueError, match="already patched"):
            kvpress.patch_model(model, "none")
    assert untouched(model) and torch.equal(model(ids).logits, reference)


def test_an_encoder_is_refused_before_anything_changes():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 vocab_size=50)).eval()
    with pytest.raises(ValueError, match=r"attention \(BertSelfAttention\) is not causal"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    assert untouched(model)


def test_a_patch_that_fails_while_installing_leaves_the_model_untouched(monkeypatch):
    from kvpress.integrations import patch as patch_module

    model = tiny_model("llama")

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(patch_module, "wrap_forward", broken)  # the last step but one of the installation
    with pytest.raises(RuntimeError, match="injected"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4, prefill_chunk_size=16)
    assert untouched(model) and "forward" not in model.__dict__ and "forward" not in model.model.__dict__
    monkeypatch.undo()
    kvpress.patch_model(model, "snapkv", compression_ratio=0.5).unpatch()  # not "already patched"
    assert untouched(model)


class SlowToCheck(kvpress.policies.SnapKV):
    """SnapKV whose check against the model takes a while: threads patching at once all reach it."""

    def for_model(self, model):
        time.sleep(0.05)
        return super().for_model(model)


def test_threads_patching_one_model_at_once_leave_exactly_one_patch():
    """Both used to succeed (11 of 40 trials with a tight switch interval); every forward then raised."""
    model = tiny_model("llama")
    ids = prompt(40)
    expected = greedy(model, ids, 4)
    start = threading.Barrier(3)
    patches, errors = [], []

    def patch():
        start.wait()
        try:
            patches.append(kvpress.patch_model(model, SlowToCheck(compression_ratio=0.5, window_size=4)))
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=patch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(patches) == 1 and len(errors) == 2 and all("already patched" in e for e in errors)
    greedy(model, ids, 4)  # the patched model runs
    patches[0].unpatch()
    assert untouched(model) and torch.equal(greedy(model, ids, 4), expected)


def test_threads_speculating_on_one_unpatched_model_share_its_patch(monkeypatch):
    """speculative_generate patches an unpatched model for the call: calls on several threads share that patch (two
    of them used to patch it at once, 2 runs of 3)."""
    from kvpress.integrations import scoped

    real_install = scoped.install

    def slow_install(*args, **kwargs):  # every thread reaches patching before the first is done
        time.sleep(0.05)
        return real_install(*args, **kwargs)

    monkeypatch.setattr(scoped, "install", slow_install)
    model = tiny_model("llama")
    prompts = [prompt(40 + 5 * i, seed=i) for i in range(3)]
    expected = [greedy(model, ids, 12) for ids in prompts]
    results, errors = {}, []
    start = threading.Barrier(3)

    def speculate(i):
        start.wait()
        try:
            for _ in range(2):
                results.setdefault(i, []).append(kvpress.speculative_generate(
                    model, prompts[i], draft="sink_window", draft_budget=16, gamma=3, max_new_tokens=12,
                    eos_token_id=[]))
        except Exception as e:  # noqa: BLE001 - the test reports every failure
            errors.append(repr(e))

    threads = [threading.Thread(target=speculate, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(torch.equal(out, expected[i]) for i, outs in results.items() for out in outs)
    assert untouched(model)


def test_a_patched_model_deep_copies_into_a_patched_copy():
    """copy.deepcopy of a patched model (it failed: cannot pickle '_InFlight'): the copy is the model as it was,
    patched again with the same policy; each runs on its own, and unpatching the copy leaves the original patched."""
    model = tiny_model("llama")
    ids = prompt(40)
    unpatched = greedy(model, ids, 6)
    patch = kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4)
    compressed = greedy(model, ids, 6)
    twin = copy.deepcopy(model)
    assert torch.equal(greedy(twin, ids, 6), compressed) and torch.equal(greedy(model, ids, 6), compressed)
    assert kept(prefill(twin, ids, config=twin.config)) == kept(prefill(model, ids, config=model.config))
    kvpress.unpatch(twin)
    assert untouched(twin) and torch.equal(greedy(twin, ids, 6), unpatched)
    assert torch.equal(greedy(model, ids, 6), compressed)  # the original is still patched
    patch.unpatch()
    assert untouched(model)


# ---------------------------------------------------------------------------- 4: a cache for another model
@pytest.mark.parametrize("config", ["llama", 42, {"num_hidden_layers": 2}])
def test_a_cache_config_that_is_not_a_config_is_refused(config):
    with pytest.raises(ValueError, match=r"config=.*; allowed values: None, or the model's config"):
        KVPressCache(config)


def test_a_cache_built_from_another_models_config_is_refused_before_anything_runs():
    """A Gemma-3 config used on a Llama made layer 0 a sliding-window layer of 8 tokens (the output changed)."""
    model, gemma = tiny_model("llama"), tiny_model("gemma3")
    ids = prompt(40)
    with kvpress.patch_model(model, "none"):
        cache = KVPressCache(gemma.config)
        with pytest.raises(ValueError, match=r"cache: a KVPressCache built for another model's layers .* allowed "
                                             r"values: KVPressCache\(model.config\)"):
            model(ids, cache=cache)
        assert all(not getattr(layer, "is_initialized", False) for layer in cache.layers)
        same = KVPressCache(model.config)
        torch.testing.assert_close(model(ids, cache=same).logits, model(ids).logits)


# ---------------------------------------------------------------------------- 5: parameters changed under a patch
def test_a_policy_in_use_cannot_change_its_parameters():
    """patch.policy.group_size = 12 was not checked against the model (head_dim 16): the next generate crashed with
    a reshape error. While a patch uses a policy its parameters are fixed; a copy, or the policy after unpatch,
    can change."""
    import dataclasses

    model = tiny_model("llama")
    ids = prompt(40)
    patch = kvpress.patch_model(model, "kivi", bits=4, group_size=16, residual_length=16)
    expected = greedy(model, ids, 6)
    with pytest.raises(ValueError, match=r"kivi: group_size=12 while a patch uses this policy"):
        patch.policy.group_size = 12
    assert patch.policy.group_size == 16 and torch.equal(greedy(model, ids, 6), expected)
    assert dataclasses.replace(patch.policy, group_size=8).group_size == 8
    copied = copy.deepcopy(patch.policy)
    copied.group_size = 8
    assert copied.group_size == 8
    patch.unpatch()
    patch.policy.group_size = 8  # no patch uses it any more


# ---------------------------------------------------------------------------- 9: attention weights
def test_output_attentions_under_a_patch_is_refused_not_empty():
    """kvpress's own read path returns no attention weights: output_attentions=True with a KVPressCache gave empty
    tuples with no word. Without a cache the model's own attention runs, weights included."""
    model = tiny_model("llama", attn="eager")
    ids = prompt(80)
    plain = model(ids, output_attentions=True).attentions
    with kvpress.patch_model(model, "none"):
        cache = KVPressCache(model.config)
        with pytest.raises(ValueError, match=r"output_attentions=True: .* returns no attention weights"):
            model(ids, cache=cache, output_attentions=True)
        assert cache.get_seq_length() == 0
        with pytest.raises(ValueError, match=r"output_attentions=True"):
            model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
        weights = model(ids, output_attentions=True).attentions  # no KVPressCache: the model's own attention
    assert [w.shape for w in weights] == [(1, 4, 80, 80)] * 2
    assert all(torch.equal(a, b) for a, b in zip(weights, plain))


def test_hidden_states_of_a_chunked_prompt_are_refused_not_cut():
    """A chunked prompt's forward would return the hidden states of its last chunk only."""
    model = tiny_model("llama")
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4, prefill_chunk_size=16):
        cache = KVPressCache(model.config)
        with pytest.raises(ValueError, match=r"output_hidden_states=True with prefill_chunk_size"):
            model(prompt(40), cache=cache, output_hidden_states=True)
        assert cache.get_seq_length() == 0


# ---------------------------------------------------------------------------- 11: autograd history
def tensors_in(obj, seen=None):
    """Every tensor reachable from obj through attributes, dataclass fields, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("kvpress", "transformers.cache_utils")):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_in(child, seen)]


@pytest.mark.parametrize("arch,policy,params", [
    ("llama", "snapkv", dict(compression_ratio=0.75, window_size=4)),
    ("llama", "h2o", dict(compression_ratio=0.5)),
    ("llama", "expected_attention", dict(compression_ratio=0.5, decode_budget=4)),
    ("llama", "kvzip+kivi", dict(compression_ratio=0.5, tokenizer=TOK, bits=4, group_size=16, residual_length=16)),
    ("gemma3", "snapkv", dict(compression_ratio=0.5, window_size=4)),
])
def test_a_prefill_without_no_grad_stores_no_autograd_history(arch, policy, params):
    """The README's compress-once recipe run without torch.no_grad(): the cache kept the forward's autograd graph
    alive through its tensors (RSS +1.9 GiB for an 11 MiB cache) and copy.deepcopy(cache) failed. Stored tensors
    carry no history; what is kept equals the no_grad run."""
    model = tiny_model(arch)
    ids = prompt(64)
    with kvpress.patch_model(model, policy, **params):
        cache = KVPressCache(model.config)
        model(ids, cache=cache)  # gradients enabled
        model(ids[:, :1], cache=cache)  # and a decode step
        reference = KVPressCache(model.config)
        with torch.no_grad():
            model(ids, cache=reference)
            model(ids[:, :1], cache=reference)
    stored = tensors_in(cache)
    assert stored and not any(t.requires_grad or t.grad_fn is not None for t in stored)
    assert kept(cache) == kept(reference)
    assert kept(copy.deepcopy(cache)) == kept(cache)


# ---------------------------------------------------------------------------- 6: rollback
def decoded(model, ids, steps, cache):
    """`cache` after the prompt and `steps` greedy decode steps (no autograd)."""
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        for _ in range(steps):
            logits = model(logits[:, -1:].argmax(-1), cache=cache).logits
    return logits


def layer_state(cache):
    return [(layer.seen, layer.view_width, layer.quantized_len, layer.keys_view().clone(), layer.key_positions().clone())
            for _, layer in cache.kvpress_layers()]


def same_state(a, b):
    return all(x[:3] == y[:3] and torch.equal(x[3], y[3]) and torch.equal(x[4], y[4]) for x, y in zip(a, b))


@pytest.mark.parametrize("policy,params,steps,floor_back", [
    ("h2o", dict(compression_ratio=0.5), 3, 0),  # evicts at every decode step
    ("kivi", dict(bits=4, group_size=16, residual_length=16), 10, -2),  # flushes a group after step 8
])
def test_crop_refuses_what_it_cannot_roll_back_and_leaves_the_cache_as_it_was(policy, params, steps, floor_back):
    """cache.crop(-3) after decode-time eviction (h2o) or a low-bit flush (kivi) returned without error but not to
    the earlier state (h2o: the next logits moved by 0.039; kivi: 48 quantized tokens where 32 were)."""
    model = tiny_model("llama")
    ids = prompt(40)
    with kvpress.patch_model(model, policy, **params):
        cache = KVPressCache(model.config)
        decoded(model, ids, steps, cache)
        before = layer_state(cache)
        with pytest.raises(ValueError, match=rf"crop\(tokens_to_remove=-3\): the layer changed its stored tokens "
                                             rf"after {40 + steps + floor_back} tokens"):
            cache.crop(-3)
        assert same_state(layer_state(cache), before)
        if floor_back:  # back to the floor is exact: the cache a plain run holds at that length
            cache.crop(floor_back)
            fresh = KVPressCache(model.config)
            decoded(model, ids, steps + floor_back, fresh)
            assert same_state(layer_state(cache), layer_state(fresh))


def test_crop_after_prefill_only_eviction_gives_back_the_earlier_cache():
    model = tiny_model("llama")
    ids = prompt(40)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=4):
        cache, fresh = KVPressCache(model.config), KVPressCache(model.config)
        decoded(model, ids, 5, cache)
        decoded(model, ids, 2, fresh)
        cache.crop(-3)
        assert same_state(layer_state(cache), layer_state(fresh))
        with pytest.raises(ValueError, match=r"after 40 tokens"):  # into the prompt, which the prefill evicted
            cache.crop(-3)


# ---------------------------------------------------------------------------- 7: speculation over a patch
@pytest.mark.parametrize("policy,params,match", [
    ("snapkv", dict(compression_ratio=0.5, window_size=4, decode_budget=8), r"evicts generated tokens beyond "
                                                                             r"decode_budget=8 while decoding"),
    ("keydiff", dict(compression_ratio=0.5, decode_budget=4), r"decode_budget=4"),
    ("h2o+kivi", dict(compression_ratio=0.5, bits=8, group_size=16, residual_length=16), r"evicts tokens while"),
])
def test_speculation_refuses_a_patch_that_changes_decode_steps(policy, params, match):
    """snapkv with decode_budget=8 differed from plain greedy at token 19; keydiff decode_budget=4 failed mid-run."""
    model = tiny_model("llama")
    with kvpress.patch_model(model, policy, **params):
        with pytest.raises(ValueError, match=rf"model is patched with .*, which .*{match}.*: a rejected draft could "
                                             r"not be rolled back exactly"):
            kvpress.speculative_generate(model, prompt(60), draft_budget=16, max_new_tokens=8)


@pytest.mark.parametrize("residual", [0, 16])
def test_speculation_over_a_codec_equals_plain_greedy_over_it(residual):
    """kivi residual_length=0 failed mid-run ("reach into the quantized segment"); with a residual, drafts flushed
    groups earlier than plain decoding would. Rounds now stop short of each flush: tokens equal plain greedy's
    over the same codec, and the cache holds the same codes."""
    model = tiny_model("llama")
    ids = prompt(60)
    with kvpress.patch_model(model, "kivi", bits=4, group_size=16, residual_length=residual):
        expected = greedy(model, ids, 40)
        for gamma in (1, 3, 5):
            out = kvpress.speculative_generate(model, ids, draft="sink_window", draft_budget=16, gamma=gamma,
                                               max_new_tokens=40, eos_token_id=[])
            assert torch.equal(out, expected), gamma


# ---------------------------------------------------------------------------- 8: transformers' assisted decoding
@pytest.mark.parametrize("policy,params", [("h2o", dict(compression_ratio=0.5)),
                                           ("streaming_llm", dict(compression_ratio=0.6)),
                                           ("snapkv", dict(compression_ratio=0.5, window_size=4)),
                                           ("kivi", dict(bits=4, group_size=16, residual_length=16))])
@pytest.mark.parametrize("assisted", ["prompt_lookup", "assistant_model"])
def test_assisted_decoding_is_refused_under_a_compressing_policy(policy, params, assisted):
    """Assisted and prompt-lookup decoding verify the prompt and the first drafts in one forward, then crop rejected
    drafts: under compression that is not lossless (SmolLM2 + streaming_llm 0.6 differed at token 10; the prompt's
    eviction judges unverified drafts) and it was not refused."""
    model = tiny_model("llama")
    ids = prompt(40)
    kwargs = dict(prompt_lookup_num_tokens=3) if assisted == "prompt_lookup" else dict(assistant_model=tiny_model())
    with kvpress.patch_model(model, policy, **params):
        with pytest.raises(ValueError, match=rf"{list(kwargs)[0]}: transformers' assisted / prompt-lookup decoding .* "
                                             r"allowed: kvpress.speculative_generate"):
            greedy(model, ids, 8, **kwargs)


def test_prompt_lookup_under_policy_none_equals_plain_greedy():
    model = tiny_model("llama")
    ids = torch.cat([prompt(30), prompt(30)], 1)  # repeated text: prompt lookup finds drafts
    expected = greedy(model, ids, 12)
    with kvpress.patch_model(model, "none"):
        assert torch.equal(greedy(model, ids, 12, prompt_lookup_num_tokens=3), expected)


# ---------------------------------------------------------------------------- 10: a short first chunk
def test_a_first_chunk_shorter_than_the_window_keeps_the_attention_sink():
    """The first chunk takes the prompt's remainder (here 2 tokens of 50 with chunks of 16): SnapKV's window covered
    the whole chunk and its share of the budget (1 token) kept the newest, so position 0 was evicted in every head.
    A chunk shorter than the window is kept whole; the next chunks hold it as earlier tokens."""
    model = tiny_model("llama")
    ids = prompt(50)
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=8, prefill_chunk_size=16):
        cache = prefill(model, ids, config=model.config)
    held = kept(cache)
    assert all(head[:2] == [0, 1] for layer in held for row in layer for head in row)
    assert all(len(head) == 25 for layer in held for row in layer for head in row)  # the budget still holds


@pytest.mark.real_model
def test_smollm2_chunked_snapkv_with_a_short_first_chunk_keeps_the_sink(smollm2):
    """SnapKV 0.3, chunks of 200 on a 215-token prompt (first chunk 15 tokens) dropped position 0 in every head and
    moved the first logits by 9.1."""
    model, tok = smollm2
    text = " ".join(f"Item {i} is stored in box {i * 37 % 101}." for i in range(40))
    ids = tok(text, return_tensors="pt").input_ids[:, :215]
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.3, prefill_chunk_size=200):
        cache = prefill(model, ids, config=model.config)
    assert all(head[0] == 0 for layer in kept(cache) for row in layer for head in row)


# ---------------------------------------------------------------------------- 17: budgets under a ratio
@pytest.mark.parametrize("n,ratio,keep", [(2002, 0.75, 500), (96, 0.6, 38), (83, 0.5, 41), (100, 0.07, 93),
                                          (200, 0.75, 50), (10, 0.0, 10), (3, 0.9, 1)])
def test_a_ratio_budget_is_never_a_token_over_the_ratio(n, ratio, keep):
    """N - floor(N r) kept 501 of 2002 tokens at 0.75, where the ratio promises at most 500 (N - ceil(N r)); a product
    whole up to rounding (100 x 0.07) removes exactly that many; at least one token stays."""
    policy = kvpress.policies.SnapKV(compression_ratio=ratio)
    assert int(policy.row_budget(torch.tensor([n]))[0]) == keep
    assert keep <= max(1, n * (1 - ratio) + 1e-9)
