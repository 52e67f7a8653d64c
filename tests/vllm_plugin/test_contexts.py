"""Per-request kvpress settings in vLLM: a declared context compressed once and shared by later requests, policies
per request, bad settings failing their request only, and pages never leaking with prefix caching on."""

import pytest
import torch
from vllm import SamplingParams, TokensPrompt

import kvpress
from kvpress.integrations.hf import with_cache
from kvpress.integrations.prompts import evicted_tokens
from kvpress.needle import needle_prompt
from kvpress.policies import resolve_policy

from engines import PAGE, engine, ids, kv_manager, scheduler, worker

RATIO = 0.75
NEW = 12
ENGINE = {"policy": "snapkv", "compression_ratio": RATIO}


@pytest.fixture(scope="module")
def llm():
    with engine(ENGINE, enable_prefix_caching=True, max_num_seqs=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def document(tokenizer):
    """A 1,500-token needle document (context) and two questions about it, as token ids."""
    doc = ids(needle_prompt(tokenizer, 1500, depth=0.4, seed=7))[:-12]
    questions = [tokenizer(q).input_ids for q in (" Question: what is the secret number? Answer:",
                                                   " What number was hidden in the text? It is")]
    return doc, questions


def params(settings: dict | None = None, **kw) -> SamplingParams:
    extra = {} if settings is None else {"extra_args": {"kvpress": settings}}
    return SamplingParams(**{"max_tokens": NEW, "temperature": 0, **kw}, **extra)


def run(llm, prompts, sampling) -> list:
    sampling = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)


def transformers_answer(model, name, params_, context, question, kept):
    """The transformers path, query-agnostic: `context` compressed alone to `kept` tokens per head, then the
    question asked over a fork of that cache (CompressedContext.ask's order), greedy."""
    policy = resolve_policy(name, budget=kept, **params_)
    ctx = torch.tensor([context])
    full = torch.tensor([context + question])
    with kvpress.patch_model(model, policy), torch.no_grad():
        cache = kvpress.KVPressCache(model.config)
        model(**with_cache(model, cache, input_ids=ctx, attention_mask=torch.ones_like(ctx), use_cache=True))
        out = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=NEW, do_sample=False,
                             **with_cache(model, cache.fork()))
    return out[0, full.shape[1]:].tolist()


def test_a_context_is_compressed_once_and_shared_by_later_requests(llm, hf, document):
    assert scheduler(llm).kv_cache_manager.enable_caching  # kvpress leaves vLLM's prefix caching on
    doc, questions = document
    end = len(doc) // PAGE * PAGE  # the context, rounded down to whole pages; its last tokens go with the question
    evicted = evicted_tokens(resolve_policy(**ENGINE), end, PAGE)
    counted = scheduler(llm).kvpress_stats()
    first, second = (run(llm, [doc + q], params({"context_tokens": len(doc)}))[0] for q in questions)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == end  # handed the compacted context: none of its tokens computed again
    now = scheduler(llm).kvpress_stats()  # the engine's figures (metrics.py) say so
    assert {k: now[k] - counted[k] for k in ("prompts_compressed", "contexts_compacted", "context_hits")} == \
        {"prompts_compressed": 1, "contexts_compacted": 1, "context_hits": 1}
    assert now["contexts_held"] >= 1
    for out, q in zip((first, second), questions):
        expected = transformers_answer(hf, "snapkv", {}, doc[:end], doc[end:] + q, end - evicted)
        assert list(out.outputs[0].token_ids) == expected
    # a request whose own policy differs shares nothing with them, and is the transformers path's under its policy
    other = run(llm, [doc + questions[1]], params({"policy": "keydiff", "compression_ratio": 0.5,
                                                   "context_tokens": len(doc)}))[0]
    assert other.num_cached_tokens == 0
    kept = end - evicted_tokens(resolve_policy("keydiff", compression_ratio=0.5), end, PAGE)
    assert list(other.outputs[0].token_ids) == transformers_answer(hf, "keydiff", {}, doc[:end],
                                                                   doc[end:] + questions[1], kept)


def test_stock_and_compressed_requests_never_share_pages(llm, document):
    doc, (q, _) = document
    prompt = doc + q
    stock_alone = run(llm, [prompt], params({"policy": "none"}))[0]  # stock pages of this prompt are cached now
    compressed, stock = run(llm, [prompt, prompt], [params({"context_tokens": len(doc)}), params({"policy": "none"})])
    assert stock.num_cached_tokens == len(prompt) // PAGE * PAGE  # stock pages, shared with the stock request
    assert compressed.num_cached_tokens in (0, len(doc) // PAGE * PAGE)  # never stock pages: none, or its own
    assert stock.outputs[0].token_ids == stock_alone.outputs[0].token_ids
    # while both run, their block lists share no page
    for request_id, settings in (("c", {"context_tokens": len(doc)}), ("s", {"policy": "none"})):
        llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt),
                                   params(settings, ignore_eos=True))
    for _ in range(3):
        llm.llm_engine.step()
    blocks = kv_manager(llm).req_to_blocks
    held = {r.split("-")[0]: {b.block_id for b in bs if not b.is_null} for r, bs in blocks.items()}
    c, s = held["c"], held["s"]
    assert c and s and not c & s
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def test_a_batch_mixing_settings_gives_each_request_what_it_gives_alone(llm, tokenizer):
    prompts = [ids(needle_prompt(tokenizer, n, depth=0.5, seed=s)) for n, s in ((900, 11), (1300, 12), (700, 13))]
    settings = [None, {"policy": "knorm", "compression_ratio": 0.5}, {"policy": "none"},
                {"policy": "streaming_llm", "compression_ratio": 0.9}]
    cases = [(p, s) for p in prompts for s in settings]
    alone = [run(llm, [p], params(s))[0].outputs[0].token_ids for p, s in cases]
    together = run(llm, [p for p, _ in cases], [params(s) for _, s in cases])
    assert [o.outputs[0].token_ids for o in together] == alone
    # and the settings really differ: the uncompressed answers are not all the compressed ones
    assert any(alone[i] != alone[i + 2] for i in range(0, len(cases), len(settings)))


@pytest.mark.parametrize("settings, message", [
    ({"policy": "nope"}, "policy='nope' is unknown"),
    ({"compression_ratio": 0.5}, "without a 'policy'"),
    ({"policy": "snapkv", "compression_ratio": 1.5}, "compression_ratio=1.5"),
    ({"policy": "quest"}, "quest"),
    ({"policy": "kvzap", "compression_ratio": 0.5}, "attention input"),
    ({"context_tokens": 0}, "context_tokens=0"),
    ({"context_tokens": 10_000}, "context_tokens=10000 for a prompt of"),
    ("{not json", "is not JSON"),
    ({"policy": "streaming_llm", "budget": 200, "slack": 100}, r"slack = k \* 128 - 1"),
    ({"policy": "tova", "budget": 200, "slack": 127, "context_tokens": 100}, "context_tokens with decode-time"),
])
def test_bad_request_settings_fail_that_request_only(llm, settings, message):
    with pytest.raises(ValueError, match=message):
        run(llm, [[1, 2, 3] * 100], params(settings))
    assert run(llm, [[1, 2, 3] * 100], params())[0].outputs[0].token_ids  # the engine serves on


def test_a_flat_kvpress_key_is_refused_not_ignored(llm):
    with pytest.raises(ValueError, match="kvpress reads one key"):
        run(llm, [[1, 2, 3] * 100], SamplingParams(max_tokens=2, extra_args={"kvpress_policy": "knorm"}))


def test_settings_as_json_text_as_the_server_passes_them(llm, document):
    doc, (q, _) = document
    as_text = run(llm, [doc + q], params('{"context_tokens": %d}' % len(doc)))[0]
    as_dict = run(llm, [doc + q], params({"context_tokens": len(doc)}))[0]
    assert as_text.outputs[0].token_ids == as_dict.outputs[0].token_ids


def test_nothing_leaks_through_aborts_preemption_and_prefix_cache_eviction(tokenizer):
    docs = [ids(needle_prompt(tokenizer, 600, depth=0.5, seed=s))[:-12] for s in range(3)]
    question = tokenizer(" Question: what is the secret number? Answer:").input_ids
    # 10 pages: each request holds 5 pages at its context's end, 2 once compacted (+1 for its question), and grows
    # while decoding 400 tokens, so running requests are preempted; compacted contexts are evicted from the prefix
    # cache as later requests need their pages
    with engine(ENGINE, enable_prefix_caching=True, kv_cache_memory_bytes=10 * PAGE * 30 * 2 * 3 * 64 * 4,
                max_num_batched_tokens=512, max_model_len=1024) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        total = pool.get_num_free_blocks()
        reference = [run(llm, [d + question], params({"context_tokens": len(d)}))[0].outputs[0].token_ids
                     for d in docs]
        sampling = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        cutting = params({"policy": "streaming_llm", "budget": 200, "slack": PAGE - 1}, ignore_eos=True,
                         max_tokens=400)  # decode-time eviction: a page back every 128 tokens
        for i in range(11):  # contexts (odd), stock (0, 4, 8), decode-time eviction (2, aborted; 6, 10)
            d = docs[i % 3]
            kind = params({"context_tokens": len(d)}, ignore_eos=True, max_tokens=400) if i % 2 else \
                sampling if i % 4 == 0 else cutting
            llm.llm_engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=d + question), kind)
        preemptions = steps = 0
        finished = {}
        while llm.llm_engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in llm.llm_engine.step() if o.finished})
            steps += 1
            preemptions = max(preemptions, sum(r.num_preemptions for r in scheduler(llm).requests.values()))
            if steps == 1:
                llm.llm_engine.abort_request(["r1"])
            if steps == 8:
                llm.llm_engine.abort_request(["r2"])
        assert preemptions > 0, "the pool was meant to force a preemption"
        assert pool.get_num_free_blocks() == total
        assert scheduler(llm).kvpress_stats()["contexts_evicted"] > 0  # counted as the block pool evicts them
        # after all that, each context answers as it did first (from its cached pages, or computed again)
        again = [run(llm, [d + question], params({"context_tokens": len(d)}))[0].outputs[0].token_ids for d in docs]
        assert again == reference
        # a request that evicts while decoding, preempted or not, generates what it generates alone (a recomputed
        # one computes its generated tokens in steps that end where its decode steps cut)
        for i in (6, 10):
            alone = run(llm, [docs[i % 3] + question], cutting)[0].outputs[0].token_ids
            assert finished[next(r for r in finished if r.split("-")[0] == f"r{i}")] == alone
        assert pool.get_num_free_blocks() == total
        requests = worker(llm).requests
        run(llm, [[1, 2, 3]], SamplingParams(max_tokens=2))
        assert not requests._compressing and not requests._decoding


def test_a_compiled_engine_serves_shared_contexts(hf, document):
    """Every other engine in these tests runs eagerly (they start in seconds); this one compiles the model (vLLM's
    CPU default), with kvpress's backend as its attention. (It does not use the module's engine: an engine shut
    down in this process takes vLLM's parallel groups with it.)"""
    doc, (q, _) = document
    end = len(doc) // PAGE * PAGE
    sampling = params({"context_tokens": len(doc)})
    with engine(ENGINE, enable_prefix_caching=True, enforce_eager=False) as compiled:
        first, second = (run(compiled, [doc + q], sampling)[0] for _ in range(2))
    assert second.num_cached_tokens == end
    expected = transformers_answer(hf, "snapkv", {}, doc[:end], doc[end:] + q,
                                   end - evicted_tokens(resolve_policy(**ENGINE), end, PAGE))
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == expected
