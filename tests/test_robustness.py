"""Nothing goes silently wrong: threads sharing one patched model, models dropped while patched, a stock cache or a
changed attention implementation under a patch, hyper-parameters of the wrong kind, speculative decoding on a
hybrid sliding-window model and around EOS."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
from transformers import DynamicCache

import kvpress
from kvpress import KVPressCache
from kvpress.policies import resolve_policy
from kvpress.speculative import DRAFTS, speculative_generate

from conftest import TOK, greedy, tiny_model
from test_speculative import DRAFT_PARAMS

THREAD_POLICIES = [("snapkv", dict(compression_ratio=0.5)), ("h2o", dict(compression_ratio=0.5)),
                   ("keyformer", dict(compression_ratio=0.5)), ("tova", dict(compression_ratio=0.5)), ("streaming_llm", dict(compression_ratio=0.5)),
                   ("freqkv", dict(compression_ratio=0.5)), ("subgen", dict(compression_ratio=0.5, recent=8)),
                   ("expected_attention", dict(compression_ratio=0.5)), ("kivi", dict(bits=4, group_size=16,
                                                                                      residual_length=16)),
                   ("quest", dict(budget=24)), ("token_select", dict(budget=24, n_init=2, n_local=6)), ("kvzip", dict(compression_ratio=0.5, tokenizer=TOK)),
                   ("laq", dict(compression_ratio=0.5, window_size=8, draft_window=16, lookahead=4)),
                   ("snapkv+kivi", dict(compression_ratio=0.5, bits=4, group_size=16, residual_length=16))]


@pytest.mark.parametrize("policy,params", THREAD_POLICIES)
def test_two_threads_share_one_patched_model(policy, params):
    """A web server's shape: one patched model, several threads generating at once. The live cache is bound per
    forward call and per thread, so every output equals the single-threaded one."""
    model = tiny_model("llama")
    prompts = [torch.randint(3, 128, (1, 40 + 7 * i)) for i in range(6)]
    with kvpress.patch_model(model, policy, **params):
        expected = [greedy(model, ids, 6).tolist() for ids in prompts]
        results, errors = {}, []

        def worker(w):
            try:
                for call in range(30):
                    i = (call + w) % len(prompts)
                    results[(w, call)] = (i, greedy(model, prompts[i], 6).tolist())
            except Exception as e:  # noqa: BLE001 - the test reports every failure
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert len(results) == 60
    assert all(out == expected[i] for i, out in results.values())


def test_unpatch_waits_for_a_generate_running_on_another_thread():
    """unpatch() from one thread while another is generating on the patched model waits for that call, which
    finishes compressed exactly as it would alone; then the model is restored."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40))
    patch = kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    expected = greedy(model, ids, 6).tolist()
    started, release = threading.Event(), threading.Event()
    calls = []

    def hold_second_forward(module, args):  # the generating thread stops in its first decode step
        calls.append(1)
        if len(calls) == 2:
            started.set()
            release.wait(10)

    hold = model.model.layers[0].register_forward_pre_hook(hold_second_forward)
    out = {}
    generating = threading.Thread(target=lambda: out.setdefault("tokens", greedy(model, ids, 6).tolist()))
    unpatching = threading.Thread(target=patch.unpatch)
    generating.start()
    assert started.wait(10)
    unpatching.start()
    unpatching.join(0.3)
    assert unpatching.is_alive() and model.config._attn_implementation == "kvpress_sdpa"  # waiting for the call
    release.set()
    generating.join(10)
    unpatching.join(10)
    hold.remove()
    assert out["tokens"] == expected
    assert model.config._attn_implementation == "sdpa"


def test_patching_and_unpatching_on_one_thread_never_gives_another_wrong_tokens():
    """One thread patches and unpatches in a loop while another generates with the model: each generate returns
    the plain model's tokens or the compressed ones (whichever state it ran in from start to end), or raises
    kvpress's error for a stock cache that a patch met half-way; never anything else."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40))
    plain = greedy(model, ids, 6).tolist()
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        compressed = greedy(model, ids, 6).tolist()
    assert plain != compressed
    stop, outcomes = threading.Event(), []

    def toggle():
        while not stop.is_set():
            with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
                time.sleep(0.002)
            time.sleep(0.002)

    toggling = threading.Thread(target=toggle)
    toggling.start()
    try:
        for _ in range(40):
            try:
                tokens = greedy(model, ids, 6).tolist()
                outcomes.append("plain" if tokens == plain else "compressed" if tokens == compressed else "WRONG")
            except (ValueError, RuntimeError) as e:
                assert "kvpress" in str(e) or "cache=DynamicCache" in str(e) or "patch" in str(e), e
                outcomes.append("raised")
    finally:
        stop.set()
        toggling.join(10)
    assert "WRONG" not in outcomes
    assert not model.config._attn_implementation.startswith("kvpress")


def test_a_compressed_cache_run_by_the_unpatched_model_raises():
    """Slots that are no longer positions 0..n-1 (evicted, or low-bit) would be read as plain keys by the model's
    own attention: continuing such a cache after unpatch() raises, naming patch_model; an uncompressed one runs."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40))
    for policy, params, compressed in (("snapkv", dict(compression_ratio=0.5), True),
                                       ("kivi", dict(bits=4, group_size=8, residual_length=8), True),
                                       ("none", {}, False)):
        cache = KVPressCache(model.config)
        with kvpress.patch_model(model, policy, **params), torch.no_grad():
            logits = model(ids, cache=cache).logits[:, -1:]
        step = dict(input_ids=logits.argmax(-1), cache=cache)
        if compressed:
            seen = cache.get_seq_length()
            with pytest.raises(RuntimeError, match="not patched by kvpress.*patch_model"):
                model(**step)
            assert cache.get_seq_length() == seen
        else:
            with torch.no_grad():
                model(**step)


def test_models_dropped_while_patched_are_freed():
    refs = []
    for seed in range(20):
        model = tiny_model("llama", seed=seed)
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
        greedy(model, torch.randint(3, 128, (1, 24)), 2)
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert [r() is None for r in refs] == [True] * 20


def test_the_cache_is_not_kept_after_generate():
    model = tiny_model("llama")
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        cache = KVPressCache(model.config)
        greedy(model, torch.randint(3, 128, (1, 24)), 2, cache=cache)
        ref = weakref.ref(cache)
        del cache
        gc.collect()
        assert ref() is None


def test_a_stock_cache_under_a_patch_raises_before_anything_runs():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 24))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        cache = DynamicCache()
        with pytest.raises(ValueError, match="(cache|past_key_values)=DynamicCache"):
            greedy(model, ids, 2, cache=cache)
        assert cache.get_seq_length() == 0
        greedy(model, ids, 2, use_cache=False)  # no cache at all: nothing to compress, plain attention is right


def test_changing_the_attention_implementation_under_a_patch_raises():
    model = tiny_model("llama")
    patch = kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="attn_implementation was changed"):
        greedy(model, torch.randint(3, 128, (1, 24)), 2)
    patch.unpatch()


@pytest.mark.parametrize("name,params,match", [
    ("snapkv", dict(compression_ratio="0.5"), "compression_ratio='0.5'; allowed values: a number"),
    ("snapkv", dict(compression_ratio="abc"), "compression_ratio='abc'"),
    ("snapkv", dict(budget=True), "budget=True; allowed values: an int"),
    ("kivi", dict(bits=4.0), "bits=4.0; allowed values: an int"),
    ("streaming_llm", dict(budget=64, n_sink=True), "n_sink=True"),
    ("snapkv+", {}, "policy='snapkv\\+'"),
])
def test_hyper_parameters_of_the_wrong_kind_are_refused(name, params, match):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, name, **params)
    assert model.config._attn_implementation == before


def test_numpy_numbers_are_accepted():
    policy = resolve_policy("snapkv", budget=np.int64(40))
    assert policy.budget == 40 and type(policy.budget) is int
    assert resolve_policy("snapkv", compression_ratio=np.float32(0.5)).compression_ratio == 0.5


def test_a_changed_hyper_parameter_is_checked():
    model = tiny_model("llama")
    policy = resolve_policy("snapkv", compression_ratio=0.5)
    with kvpress.patch_model(model, policy) as patch:
        with pytest.raises(ValueError, match="compression_ratio=1.5"):
            patch.policy.compression_ratio = 1.5
        assert patch.policy.compression_ratio == 0.5


@pytest.mark.parametrize("kwargs,match", [
    (dict(gamma=True), "gamma=True"),
    (dict(draft_budget=0), "draft_budget=0; allowed values"),
    (dict(draft_budget=True), "draft_budget=True"),
])
def test_speculative_arguments_are_checked(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        speculative_generate(model, torch.randint(3, 128, (1, 40)), max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("draft", sorted(set(DRAFTS) - {"quant4"}))
def test_speculative_on_a_sliding_window_model_equals_greedy(draft):
    """Gemma-3 style: a sliding window of 8 (transformers' own layer) beside a kvpress layer; prompt and output far
    past the window, so every rejected draft must be rolled back inside the window too."""
    model = tiny_model("gemma3")
    model.generation_config.eos_token_id = None  # a random model says EOS early: generate through it, both ways
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (1, 64))
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert ref.shape[1] == 84
    for gamma in (1, 3):
        out = speculative_generate(model, ids, mask, draft=draft, gamma=gamma, max_new_tokens=20, draft_budget=16,
                                   **DRAFT_PARAMS.get(draft, {}))  # (calibrated drafts: their settings given)
        assert out.tolist() == ref.tolist(), (draft, gamma)


@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_speculative_stops_at_eos_like_generate(gamma):
    """EOS from the model's generation_config (no explicit argument), reached inside a round: the output is
    generate's, token for token and length for length, also for a left-padded batch."""
    model = tiny_model("llama")
    torch.manual_seed(5)
    ids = torch.randint(3, 128, (2, 50))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    model.generation_config.eos_token_id = None
    free = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    model.generation_config.eos_token_id = int(free[0, 50 + 5])  # a token row 0 produces at step 6
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = speculative_generate(model, ids, mask, draft="sink_window", gamma=gamma, max_new_tokens=16,
                               draft_budget=16)
    assert out.tolist() == expected.tolist()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=128,
                       word_embed_proj_dim=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    return OPTForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_gpt2, _opt])
def test_models_without_kv_head_groups_are_served(build):
    """GPT-2 / OPT run attention through transformers' AttentionInterface like Llama does (no GQA, learned
    positions): policy none is token-identical to the plain model, eviction frees bytes, and a policy that needs
    RoPE says so."""
    model = build()
    ids = torch.randint(3, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    plain = greedy(model, ids, 8, attention_mask=mask)
    with kvpress.patch_model(model, "none"):
        assert greedy(model, ids, 8, attention_mask=mask).tolist() == plain.tolist()
    with kvpress.patch_model(model, "snapkv", budget=40):  # budget >= prompt: nothing evicted, same tokens
        assert greedy(model, ids, 8, attention_mask=mask).tolist() == plain.tolist()
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        greedy(model, ids, 8, attention_mask=mask)
        stats = kvpress.last_cache_stats(model)
        assert stats["prefill_kv_bytes"] < 0.6 * 2 * 2 * 4 * 40 * 16 * 4 * 2
    with pytest.raises(ValueError, match="expected_attention"):
        kvpress.patch_model(model, "expected_attention", compression_ratio=0.5)


# Without a reserve (tests/test_capture.py has the captured steps), a decode step still compiles into one graph
# (fullgraph=True; its shapes are dynamic) where the step does not evict; policies that evict every step (h2o)
# break the graph where eviction reads data-dependent sizes. README "torch.compile" states them.
COMPILE_CASES = [("none", {}, True), ("snapkv", dict(compression_ratio=0.5, window_size=8), True),
                 ("kivi", dict(bits=4, group_size=16, residual_length=16), True),
                 ("quest", dict(budget=24), True), ("h2o", dict(compression_ratio=0.5), False)]


@pytest.mark.parametrize("policy,params,fullgraph", COMPILE_CASES)
def test_a_compiled_decode_step_equals_eager(policy, params, fullgraph):
    """torch.compile (dynamo, eager backend: no C++ toolchain needed) of the patched model's decode steps gives the
    eager logits; where no step evicts, with fullgraph=True (no graph break)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    dynamo.reset()
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        eager_cache, compiled_cache = KVPressCache(model.config), KVPressCache(model.config)
        nxt = model(ids, cache=eager_cache).logits[:, -1:].argmax(-1)
        model(ids, cache=compiled_cache)
        step = torch.compile(model, backend="eager", fullgraph=fullgraph)
        for _ in range(3):
            want = model(nxt, cache=eager_cache).logits
            torch.testing.assert_close(step(nxt, cache=compiled_cache).logits, want)
            nxt = want[:, -1:].argmax(-1)
    dynamo.reset()
