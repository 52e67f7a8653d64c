"""Behaviour recorded before a restructuring, compared after it (tests/test_golden.py).

For every policy family (eviction, allocators, chunked prefill, decode budget, codecs, compositions, read views,
self-speculative drafts, query-agnostic selection: KVzip (alone, + GEAR, chunked), ExpectedAttention, KeyDiff) on
tiny random models of three architectures (a left-padded batch of two) and on SmolLM2 (also its calibrated
policies, KVzap and DuoAttention): the greedy tokens, the kept token set of every (layer, row, KV head) after
prefill and after generation, and the bytes held. The evals engine (evals/engine.py: one shared prefill, batched
decodes) on a tiny model and on SmolLM2: per (policy, ratio) its prefill cache and its tokens. Only public API is
used, so the same script runs on both sides of a redesign.

    python tests/golden/record.py            # rewrite tests/golden/behaviour.json (do this BEFORE a redesign)
    python tests/golden/record.py random     # re-record only the cases whose key contains "random" (a behaviour
                                             # changed on purpose; every other case keeps its record)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # conftest
sys.path.insert(0, str(HERE.parent.parent))  # the repository root: kvpress, evals

import kvpress  # noqa: E402
from kvpress import KVPressCache, KVPressLayer  # noqa: E402



class CharTokenizer:
    """KVzip's replay instructions for tiny models (vocab 128), which have no tokenizer: no chat template."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 120 for c in text]


TOK = CharTokenizer()
MODEL_TOKENIZER = object()  # in SMOL_CONFIGS: stands for the real model's tokenizer (known once it is loaded)
Q = dict(bits=2, group_size=16, residual_length=16)
# (name, policy spec, patch params, extra patch kwargs)
TINY_CONFIGS = [
    ("none", "none", {}, {}),
    ("snapkv", "snapkv", dict(compression_ratio=0.6, window_size=8), {}),
    ("snapkv_adaptive", "snapkv", dict(compression_ratio=0.6, window_size=8, budget_allocation="adaptive"), {}),
    ("snapkv_pyramid", "snapkv", dict(compression_ratio=0.6, window_size=8, budget_allocation="pyramid"), {}),
    ("snapkv_chunked", "snapkv", dict(compression_ratio=0.7, window_size=8), dict(prefill_chunk_size=32)),
    ("h2o", "h2o", dict(compression_ratio=0.6), {}),
    ("h2o_decode_budget", "h2o", dict(compression_ratio=0.6, decode_budget=8), {}),
    ("h2o_adaptive", "h2o", dict(compression_ratio=0.6, budget_allocation="adaptive"), {}),
    ("tova", "tova", dict(compression_ratio=0.6), {}),
    ("streaming_llm", "streaming_llm", dict(compression_ratio=0.6), {}),
    ("streaming_llm_local", "streaming_llm", dict(compression_ratio=0.6, cache_local_positions=True), {}),
    ("knorm", "knorm", dict(compression_ratio=0.6), {}),
    ("random", "random", dict(compression_ratio=0.6), {}),
    ("kivi2", "kivi", Q, {}),
    ("kivi4", "kivi", dict(Q, bits=4), {}),
    ("gear", "gear", Q, {}),
    ("snapkv+kivi", "snapkv+kivi", dict(Q, compression_ratio=0.5, window_size=8), {}),
    ("h2o+kivi", "h2o+kivi", dict(Q, compression_ratio=0.5), {}),
    ("streaming_llm+gear", "streaming_llm+gear", dict(Q, compression_ratio=0.5), {}),
    ("quest", "quest", dict(budget=32, page_size=8), {}),
    ("retrieval", "retrieval", dict(budget=32, chunk_size=8, recent=8), {}),
    ("topk", "topk", dict(budget=24), {}),
    ("sink_window", "sink_window", dict(budget=24), {}),
    ("kvzip", "kvzip", dict(compression_ratio=0.6, chunk_size=16, tokenizer=TOK), {}),
    ("kvzip+gear", "kvzip+gear", dict(Q, compression_ratio=0.5, chunk_size=16, tokenizer=TOK), {}),
    ("kvzip_chunked", "kvzip", dict(compression_ratio=0.6, chunk_size=16, tokenizer=TOK), dict(prefill_chunk_size=32)),
    ("expected_attention", "expected_attention", dict(compression_ratio=0.6, n_future_positions=32,
                                                      use_covariance=True), {}),  # (its default when recorded)
    ("keydiff", "keydiff", dict(compression_ratio=0.6), {}),
]
DRAFTS = [("sink_window", {}), ("quest", dict(page_size=8)), ("retrieval", dict(chunk_size=8, recent=8)),
          ("topk", {}), ("quant4", dict(group_size=16, residual_length=16))]
SMOL_CONFIGS = [
    ("none", "none", {}),
    ("snapkv", "snapkv", dict(compression_ratio=0.75)),
    ("snapkv_adaptive", "snapkv", dict(compression_ratio=0.75, budget_allocation="adaptive")),
    ("h2o", "h2o", dict(compression_ratio=0.75)),
    ("tova", "tova", dict(compression_ratio=0.75)),
    ("streaming_llm", "streaming_llm", dict(compression_ratio=0.75)),
    ("knorm", "knorm", dict(compression_ratio=0.75)),
    ("kivi4", "kivi", dict(bits=4)),
    ("snapkv+kivi2", "snapkv+kivi", dict(compression_ratio=0.5, bits=2)),
    ("gear", "gear", dict(bits=4)),
    ("kvzap", "kvzap", dict(compression_ratio=0.75)),  # kvzap and duo_attention: the shipped calibration
    ("duo_attention", "duo_attention", dict(streaming_heads=0.5)),
    ("kvzip", "kvzip", dict(compression_ratio=0.75, tokenizer=MODEL_TOKENIZER)),
    ("expected_attention", "expected_attention", dict(compression_ratio=0.75, use_covariance=True)),
    ("keydiff", "keydiff", dict(compression_ratio=0.75)),
]
# evals/engine.py specs, each at every ratio of ENGINE_RATIOS if it evicts: the batches it forms (prefill-only
# rectangular, prefill-only flat, decode-time evictors under Rows, alone: low-bit, own schedule)
ENGINE_POLICIES = ["none", "snapkv", "knorm", "h2o", "tova", "streaming_llm", "expected_attention:use_covariance=True",
                   "keydiff",
                   "h2o:slack=3"]
ENGINE_TINY = ["kivi:group_size=16:residual_length=16", "snapkv+kivi:group_size=16:residual_length=16",
               "snapkv:budget_allocation=adaptive:window_size=8"]  # head_dim 16; kvzip: no tokenizer to load
ENGINE_SMOL = ["kivi", "kvzip", "kvzap"]
ENGINE_RATIOS = [0.5, 0.75]
ARCHS = ["llama", "qwen3", "gemma3"]
NEW_TOKENS = 20


def kept_sets(cache) -> list:
    """[layer][row][head] sorted original positions of the real kept tokens (kvpress layers only)."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, KVPressLayer) or not layer.is_initialized:
            continue
        pos, valid = layer.key_positions(), layer.key_valid()
        out.append([[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(pos.shape[1])]
                    for b in range(pos.shape[0])])
    return out


def digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj).encode()).hexdigest()[:16]


def cache_record(cache) -> dict:
    sets = kept_sets(cache)
    return dict(kept=digest(sets), counts=[[[len(h) for h in row] for row in layer] for layer in sets],
                nbytes=cache.nbytes(), kv_nbytes=sum(r["kv_bytes"] for r in cache.stats()))


def _tiny_inputs():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 128, (2, 96), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # a left-padded row
    return ids, mask


def run_config(model, ids, mask, spec, params, extra, new_tokens=NEW_TOKENS) -> dict:
    with kvpress.patch_model(model, spec, **extra, **params):
        with torch.no_grad():
            pre = KVPressCache(model.config)
            model(ids, attention_mask=mask, cache=pre)
        cache = KVPressCache(model.config)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return dict(tokens=out[:, ids.shape[1]:].tolist(), prefill=cache_record(pre), final=cache_record(cache))


def run_draft(model, ids, mask, draft, params, new_tokens=NEW_TOKENS) -> dict:
    kw = dict(draft_budget=24) if draft != "quant4" else {}
    # eos_token_id=[]: recorded when speculative_generate ignored the model's EOS; it now stops like generate
    # (tests/test_robustness.py), and the record keeps checking every round's tokens past EOS
    out = kvpress.speculative_generate(model, ids, mask, draft=draft, gamma=3, max_new_tokens=new_tokens, **kw,
                                       eos_token_id=[], **params)
    return dict(tokens=out[:, ids.shape[1]:].tolist())


def run_engine(model, ids, policies, question=None, new_tokens=8) -> dict:
    """evals/engine.py: one prefill shared by every config, then its batched greedy decodes (stop tokens ignored).
    Per config "policy@ratio": its prefill cache, its tokens and, given a question, its tokens after the question
    extends the compressed prompt (query-agnostic)."""
    from evals.engine import answer, configs_for, decode_batches, prefill

    configs = configs_for(policies, ENGINE_RATIOS)
    pre = prefill(model, ids, configs)
    out = {c: dict(prefill=cache_record(pre.caches[c])) for c in configs}
    modes = [("tokens", None)] + ([("question_tokens", question)] if question is not None else [])
    for batch, policy in decode_batches(pre, configs):
        for field, q in modes:
            tokens, _ = answer(model, pre, batch, policy, q, new_tokens, set())
            for c, got in zip(batch, tokens):
                out[c][field] = got
    return {f"{c.policy}@{c.ratio}": record for c, record in out.items()}


def tiny_cases():
    from conftest import tiny_model

    for arch in ARCHS:
        for name, spec, params, extra in TINY_CONFIGS:
            if arch == "qwen3" and spec == "knorm":
                # Qwen3 normalises each key (k_norm, weights all 1 in a tiny random model): every key has the same
                # norm, so knorm's kept set is decided by rounding, which differs between CPUs
                continue
            yield f"tiny/{arch}/{name}", lambda a=arch, s=spec, p=params, e=extra: run_config(
                tiny_model(a), *_tiny_inputs(), s, p, e)
        for draft, params in DRAFTS if arch != "gemma3" else []:  # gemma3: sliding layers cannot roll back yet
            yield f"tiny/{arch}/draft_{draft}", lambda a=arch, d=draft, p=params: run_draft(
                tiny_model(a), *_tiny_inputs(), d, p)
    question = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    yield "tiny/llama/evals_engine", lambda: run_engine(  # the engine takes one prompt: the batch's first row
        tiny_model("llama"), _tiny_inputs()[0][:1], ENGINE_POLICIES + ENGINE_TINY, question)


def smol_cases():
    from conftest import _real
    from kvpress.needle import needle_prompt

    def inputs():
        model, tok = _real("smollm2")
        ids = needle_prompt(tok, 600, depth=0.3, seed=3).input_ids
        return model, ids, torch.ones_like(ids)

    def with_tokenizer(params):
        tok = _real("smollm2")[1]
        return {k: tok if v is MODEL_TOKENIZER else v for k, v in params.items()}

    for name, spec, params in SMOL_CONFIGS:
        yield f"smollm2/{name}", lambda s=spec, p=params: run_config(*inputs(), s, with_tokenizer(p), {},
                                                                     new_tokens=12)
    yield "smollm2/draft_sink_window", lambda: run_draft(*inputs(), "sink_window", {}, new_tokens=12)
    # the prompt already asks its question: query-aware only (kvzip's tokenizer: loaded from the model's folder)
    yield "smollm2/evals_engine", lambda: run_engine(*inputs()[:2], ENGINE_POLICIES + ENGINE_SMOL)


def all_cases():
    yield from tiny_cases()
    yield from smol_cases()


def main(only: list[str]):
    torch.set_num_threads(2)
    path = HERE / "behaviour.json"
    record = json.loads(path.read_text()) if only else {}
    for key, run in all_cases():
        if only and not any(part in key for part in only):
            continue
        record[key] = run()
        print(key, json.dumps(record[key])[:60], flush=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
