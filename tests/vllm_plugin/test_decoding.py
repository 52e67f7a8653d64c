"""Decode-time eviction in vLLM: a request whose policy evicts while decoding (slack = k * page - 1) cuts every
layer back to its budget each time it would hold a page more, and gives that page back; its tokens are the
transformers path's under the same policy, slack included."""

import pytest
import torch
from vllm import SamplingParams, TokensPrompt

import kvpress
from kvpress.integrations.hf import with_cache
from kvpress.integrations.vllm.plans import plan_of
from kvpress.needle import needle_prompt
from kvpress.policies import resolve_policy

from engines import PAGE, engine, ids, kv_manager, scheduler, worker

NEW = 300  # two cuts of a page each for the prompts below
ENGINE = {"policy": "snapkv", "compression_ratio": 0.75}  # requests bring the policies that cut while decoding
CUTTING = [
    ("streaming_llm", {"budget": 200, "slack": PAGE - 1}),
    ("tova", {"budget": 200, "slack": PAGE - 1}),
    ("h2o", {"budget": 200, "slack": PAGE - 1}),  # observes every step: its attention sums carried between steps
    ("keydiff", {"compression_ratio": 0.5, "decode_budget": 64, "slack": PAGE - 1}),
]


@pytest.fixture(scope="module")
def llm():
    with engine(ENGINE, enable_prefix_caching=True, max_num_seqs=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return ids(needle_prompt(tokenizer, 700, depth=0.5, seed=11))


def settings(name, params) -> dict:
    return {"policy": name, **params}


def sampling(name, params, max_tokens=NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          extra_args={"kvpress": settings(name, params)})


def transformers_tokens(model, name, params, prompt, held):
    """The transformers path under the same policy and slack, at the budget the engine holds after each cut."""
    rest = {k: v for k, v in params.items() if k not in ("budget", "compression_ratio")}
    # the prompt's cut keeps its page-raised budget; decode_budget holds the generated tokens apart from it
    policy = resolve_policy(name, budget=held - params.get("decode_budget", 0), **rest)
    p = torch.tensor([prompt])
    with kvpress.patch_model(model, policy), torch.no_grad():
        cache = kvpress.KVPressCache(model.config)
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **with_cache(model, cache))  # as ignore_eos
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,params", CUTTING, ids=[c[0] for c in CUTTING])
def test_decode_time_eviction_gives_the_transformers_paths_tokens(llm, hf, prompt, name, params):
    plan = plan_of(_engine_text(llm), {"kvpress": settings(name, params)},
                   len(prompt), PAGE)
    assert plan.cut == PAGE and plan.held > 0
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling(name, params), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == transformers_tokens(hf, name, params, prompt, plan.held)


def test_each_cut_gives_a_page_back_and_memory_stays_fixed(llm, prompt):
    name, params = CUTTING[0]
    plan = plan_of(_engine_text(llm), {"kvpress": settings(name, params)}, len(prompt), PAGE)
    pool = scheduler(llm).kv_cache_manager.block_pool
    free_at_start, counted = pool.get_num_free_blocks(), scheduler(llm).kvpress_stats()
    llm.llm_engine.add_request("d", TokensPrompt(prompt_token_ids=prompt), sampling(name, params, 2 * NEW))
    held, before = [], 0  # the request's pages after each step, and the plan's prediction
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        blocks = [bs for r, bs in kv_manager(llm).req_to_blocks.items() if r.split("-")[0] == "d"]
        request = [r for r in scheduler(llm).requests.values() if r.request_id.split("-")[0] == "d"]
        if not blocks or not request:
            continue
        computed = request[0].num_computed_tokens
        # the step's pages were allocated (and the cut ones freed) when it was scheduled, `before` tokens computed
        expected = -(-computed // PAGE) - plan.evicted_at(before) // PAGE
        held.append((computed, sum(not b.is_null for b in blocks[0]), expected))
        before = computed
    assert [live for _, live, _ in held] == [expected for _, _, expected in held], held
    cuts = [c for c, _, _ in held if c > plan.end and plan.evicted_at(c) > plan.evicted_at(c - 1)]  # decode cuts
    assert len(cuts) == (len(prompt) + 2 * NEW - plan.evicted - plan.held) // plan.cut >= 4
    # while decoding, the kept KV never grows past held + cut tokens, whatever the length generated
    assert max(live for c, live, _ in held if c > plan.end) <= -(-(plan.held + plan.cut) // PAGE) + 1
    assert pool.get_num_free_blocks() == free_at_start
    # and the engine's figures say so (metrics.py: what /metrics and its log line report)
    now = scheduler(llm).kvpress_stats()
    assert now["pages_freed_decoding"] - counted["pages_freed_decoding"] == len(cuts)
    assert now["pages_freed_prompt"] - counted["pages_freed_prompt"] == plan.evicted // PAGE
    assert now["kept_tokens"] - counted["kept_tokens"] == plan.end - plan.evicted


def _engine_text(llm) -> str:
    return worker(llm).kvpress.text


def test_the_figures_are_logged_as_vllms_are(llm, monkeypatch, caplog):
    """The engine core's log line (while vLLM logs statistics: each step's make_stats), every LOG_EVERY_S seconds."""
    import logging

    from kvpress.integrations.vllm import metrics

    stats = scheduler(llm).kv_cache_manager.coordinator.single_type_managers[0].stats
    monkeypatch.setattr(metrics, "LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="kvpress"):
        stats.maybe_log()
    counts = scheduler(llm).kvpress_stats()
    assert f"kvpress: {counts['prompts_compressed']} prompts compressed" in caplog.text
    assert f"{counts['pages_freed_decoding']} while decoding" in caplog.text
