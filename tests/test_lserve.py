"""LServe reads what its definition (docs/policies.md 12.4) names: streaming heads (the calibrated static_sparsity
fraction of (layer, KV head) pairs) read sinks + local only; retrieval heads read the top max(3, budget / page) - 1
pages by their best logical page's Quest bound, plus the current page, reselected every reuse_interval tokens."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.formats.calibration import Calibration
from kvpress.policies import Context, LServe, Quest
from kvpress.speculative import speculative_generate

from conftest import greedy, tiny_model

B, HQ, HKV, T, D = 2, 4, 2, 300, 8


def _layer(seed=0, length=T):
    g = torch.Generator().manual_seed(seed)
    layer = KVPressLayer()
    layer.update(torch.randn(B, HKV, length, D, generator=g), torch.randn(B, HKV, length, D, generator=g))
    return layer


def _read(policy, layer, query):
    idx, valid = policy.select(Context(layer_idx=0, layer=layer, phase="decode", query=query, scaling=1.0))
    return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(HKV)] for b in range(B)]


def _bound_pages(query, keys, page, sub, n):
    """The reference, one head at a time: logical pages of page/sub slots with elementwise key min / max, Quest's
    bound max over the head's query rows, a page's score its best logical page; the best n pages but the last."""
    g, out = HQ // HKV, []
    for b in range(B):
        row = []
        for h in range(HKV):
            logical = page // sub
            bounds = []
            for start in range(0, keys.shape[2], logical):
                k = keys[b, h, start:start + logical]
                q = query[b, h * g:(h + 1) * g, 0]
                bounds.append(float(torch.maximum(q * k.max(0).values, q * k.min(0).values).sum(-1).max()))
            pages = [max(bounds[i:i + sub]) for i in range(0, len(bounds), sub)]
            last = len(pages) - 1
            best = sorted(range(last), key=lambda p: (-pages[p], p))[:n]
            row.append({s for p in best + [last] for s in range(p * page, min((p + 1) * page, keys.shape[2]))})
        out.append(row)
    return out


@pytest.mark.parametrize("page,sub,budget", [(16, 4, 64), (32, 2, 100), (8, 1, 40)])
def test_retrieval_heads_read_the_best_pages_by_their_best_logical_page(page, sub, budget):
    layer, query = _layer(), torch.randn(B, HQ, 1, D)
    read = _read(LServe(budget=budget, page_size=page, sub_pages=sub, static_sparsity=0.0), layer, query)
    assert read == _bound_pages(query, layer.keys_view(), page, sub, max(3, budget // page) - 1)


def test_one_sub_page_reads_what_quest_reads_with_the_same_pages():
    layer, query = _layer(1), torch.randn(B, HQ, 1, D)
    lserve = _read(LServe(budget=128, page_size=32, sub_pages=1, static_sparsity=0.0), layer, query)
    assert lserve == _read(Quest(budget=128, page_size=32), _layer(1), query)


def test_the_selection_is_reused_between_multiples_of_the_interval():
    layer, policy = _layer(2, 301), LServe(budget=64, page_size=16, sub_pages=4, static_sparsity=0.0, reuse_interval=4)
    first = _read(policy, layer, torch.randn(B, HQ, 1, D))  # 301 tokens: not a multiple of 4, but nothing cached
    for step in range(1, 4):
        layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
        read = _read(policy, layer, torch.randn(B, HQ, 1, D))
        if step < 3:  # 302, 303 tokens: the same pages, and the current page
            assert read == [[head | set(range(301, 301 + step)) for head in row] for row in first]
    assert read != [[head | {301, 302, 303} for head in row] for row in first]  # 304: selected anew


def test_streaming_heads_read_sinks_and_local_only(llama_file):
    model, ids = tiny_model(), torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    streaming = Calibration.load(llama_file).streaming_heads(0.5)
    assert any(bool(h.any()) for h in streaming.values())
    reads, real_select = [], LServe.select

    def recording(self, ctx):
        idx, valid = real_select(self, ctx)
        reads.append((ctx.layer_idx, [set(idx[0, h][valid[0, h]].tolist()) for h in range(idx.shape[1])],
                      ctx.layer.view_width))
        return idx, valid

    LServe.select = recording
    try:
        with kvpress.patch_model(model, "lserve", budget=32, page_size=8, sub_pages=2, n_sink=2, local=8,
                                 calibration=str(llama_file)):
            greedy(model, ids, 3, cache=KVPressCache(model.config))
    finally:
        LServe.select = real_select
    for layer_idx, heads, width in reads:
        for h, slots in enumerate(heads):
            if streaming[layer_idx][h]:
                assert slots == {0, 1} | set(range(width - 8, width))
            else:
                assert len(slots) <= 32 + 8 and slots != {0, 1} | set(range(width - 8, width))


def test_a_draft_with_streaming_heads_generates_the_plain_tokens(llama_file):
    model, ids = tiny_model(), torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(4))
    plain = greedy(model, ids, 16)
    out = speculative_generate(model, ids, draft="lserve", gamma=3, max_new_tokens=16, draft_budget=24,
                               page_size=8, sub_pages=2, n_sink=2, local=8, calibration=str(llama_file),
                               eos_token_id=None, pad_token_id=0)
    assert out.tolist() == plain.tolist()
    with pytest.raises(ValueError, match="calibration=None: no calibration file for this model"):
        speculative_generate(model, ids, draft="lserve", max_new_tokens=4)


@pytest.mark.parametrize("params,match", [
    (dict(page_size=10, sub_pages=4), r"page_size=10, sub_pages=4; allowed values: ints >= 1, sub_pages dividing"),
    (dict(static_sparsity=1.5), r"static_sparsity=1.5; allowed values: a fraction in \[0, 1\]"),
    (dict(reuse_interval=0), r"reuse_interval=0; allowed values: an int >= 1"),
])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(tiny_model(), "lserve", **params)
