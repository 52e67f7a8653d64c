"""A left-padded batch equals each row run alone, for every registered policy (one-shot and chunked prefill, and
with a known question), the codecs and compositions: the same generated tokens, and in every layer and head the
same kept positions (shifted by the row's padding). The registry is walked, so a new policy is covered the day it
is registered (and fails here until it is given its parameters below)."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache

from conftest import TOK, tiny_model

LONG, SHORT, NEW = 90, 77, 6  # pad 13: not a multiple of the codecs' group_size, chunk or page size below
CHUNK = 24

# Every registered policy with parameters that make it act on a 90-token prompt (budgets well below it, windows,
# pages and code groups smaller than it). "calibration" is filled in from the fixture.
PARAMS = {
    "none": {},
    "snapkv": dict(compression_ratio=0.6, window_size=8),
    "h2o": dict(compression_ratio=0.6),
    "less": dict(compression_ratio=0.6, calibration=None),
    "keyformer": dict(compression_ratio=0.6),
    "tova": dict(compression_ratio=0.6),
    "knorm": dict(compression_ratio=0.6),
    "streaming_llm": dict(compression_ratio=0.6),
    "freqkv": dict(compression_ratio=0.6, recent=3),
    "random": dict(compression_ratio=0.6),
    "expected_attention": dict(compression_ratio=0.6),
    "keydiff": dict(compression_ratio=0.6),
    "kvzip": dict(compression_ratio=0.6, chunk_size=16, tokenizer=TOK),
    "laq": dict(compression_ratio=0.6, window_size=8, draft_window=16, lookahead=4),
    "kvzap": dict(compression_ratio=0.6, calibration=None),
    "duo_attention": dict(streaming_heads=0.5, n_sink=2, window=16, slack=4, calibration=None),
    "kivi": dict(bits=2, group_size=16, residual_length=16),
    "gear": dict(bits=2, group_size=16, residual_length=16),
    "zipcache": dict(group_size=16, residual_length=16),
    "commvq": dict(key_stages=2, value_stages=3, block_size=16, residual_length=16, calibration=None),
    "quest": dict(budget=24, page_size=8),
    "retrieval": dict(budget=24),
    "sink_window": dict(budget=24),
    "topk": dict(budget=24),
    "token_select": dict(budget=24, n_init=4, n_local=8),
    "recycled_attention": dict(budget=24, stride=3),
    "hip": dict(budget=24, n_sink=2, window=6, block_size=2),
    "tidal_decode": dict(budget=16, sparse_layer_start=0, correction_layer=None),
    "lserve": dict(budget=32, page_size=8, sub_pages=2, n_sink=2, local=8, calibration=None),
    "double_sparsity": dict(budget=16, group_factor=4, dense_layers=1, calibration=None),
    "shadowkv": dict(budget=16, chunk_size=4, local_chunks=2, outlier_chunks=2),
    "subgen": dict(compression_ratio=0.6, n_sink=2, recent=8),
}
COMPOSED = {
    "snapkv+kivi": dict(compression_ratio=0.6, window_size=8, bits=2, group_size=16, residual_length=16),
    "kvzip+gear": dict(compression_ratio=0.6, chunk_size=16, tokenizer=TOK, bits=2, group_size=16,
                       residual_length=16),
    "snapkv+zipcache": dict(compression_ratio=0.6, window_size=8, group_size=16, residual_length=16),
    "kvzap+commvq": dict(compression_ratio=0.6, key_stages=2, block_size=16, residual_length=16, calibration=None),
}


def test_every_registered_policy_is_covered():
    assert set(kvpress.list_policies()) == set(PARAMS)


def _batch(n_short=SHORT):
    g = torch.Generator().manual_seed(9)
    long, short = torch.randint(3, 128, (1, LONG), generator=g), torch.randint(3, 128, (1, n_short), generator=g)
    pad = LONG - n_short
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask, short, pad


def _kept(cache, row, shift):
    return [[sorted((layer.key_positions()[row, h][layer.key_valid()[row, h]] - shift).tolist())
             for h in range(layer.key_valid().shape[1])] for _, layer in cache.kvpress_layers()]


def _assert_rows_as_alone(policy, params, n_short=SHORT, **patch):
    model = tiny_model("llama")
    ids, mask, short, pad = _batch(n_short)
    run = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
               output_logits=True)
    with kvpress.patch_model(model, policy, **params, **patch), torch.no_grad():
        batch_cache, alone_cache = KVPressCache(model.config), KVPressCache(model.config)
        batched = model.generate(ids, attention_mask=mask, cache=batch_cache, **run)
        alone = model.generate(short, attention_mask=torch.ones_like(short), cache=alone_cache, **run)
    assert batched.sequences[1, LONG:].tolist() == alone.sequences[0, n_short:].tolist()
    # the logits too: a tiny random model's tokens barely depend on what attention reads
    torch.testing.assert_close(torch.stack([step[1] for step in batched.logits]),
                               torch.stack([step[0] for step in alone.logits]), atol=1e-5, rtol=1e-4)
    assert _kept(batch_cache, 1, pad) == _kept(alone_cache, 0, 0)
    return batch_cache


def _params(name, calibration):
    params = dict(PARAMS[name] if name in PARAMS else COMPOSED[name])
    if "calibration" in params:
        params["calibration"] = str(calibration)
    return params


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_left_padded_row_equals_the_row_alone(name, llama_file):
    _assert_rows_as_alone(name, _params(name, llama_file))


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_left_padded_row_equals_the_row_alone_composed(name, llama_file):
    _assert_rows_as_alone(name, _params(name, llama_file))


def test_slack_cuts_each_row_on_its_own_schedule():
    """Budget 80 with slack 3: the long row (90 tokens) is cut to 80 at prefill and again when it passes 83; the
    short row (77) passes 83 only later. In the batch each row is cut when it passes its own limit, as alone."""
    _assert_rows_as_alone("h2o", dict(budget=80, slack=3))


@pytest.mark.parametrize("name,params", [("retrieval", dict(budget=16)), ("retrieval", dict(budget=8, recent=40)),
                                         ("quest", dict(budget=8, page_size=16))])
@pytest.mark.parametrize("n_short", [87, 60])
def test_a_view_whose_forced_pages_outnumber_its_budget_reads_them_all_as_alone(name, params, n_short):
    """Retrieval at a budget of 2 chunks with 64 recent slots must read 9-10 chunks: topk picked 2 of the forced
    ones, breaking the tie by slot order, so a padded row read other chunks than alone (SmolLM2: |dlogit| 31 at
    budget 64). Each head now reads every forced page, and its budget's best pages when those are more."""
    _assert_rows_as_alone(name, params, n_short=n_short)


def test_duo_attention_cuts_each_row_when_it_passes_its_own_limit(llama_file):
    """The 40-token row (within n_sink + window = 42 at prefill) passes 42 during decoding, before its limit of 46
    with slack 4, while the 90-token row is cut at step 5: every row was cut whenever any was (SmolLM2: batched answers
    other than asking alone). Each (row, streaming head) is now cut on its own schedule."""
    _assert_rows_as_alone("duo_attention", dict(_params("duo_attention", llama_file), n_sink=2, window=40, slack=4),
                          n_short=40)


def test_commvq_codes_every_block_size_of_a_padded_batch(llama_file):
    """block_size=1 on a padded batch: a padding slot's RoPE position (before its row's first token) was negative
    and the read refused it. Padding slots are coded at 0 (never read); the row equals itself alone."""
    _assert_rows_as_alone("commvq", dict(_params("commvq", llama_file), block_size=1, residual_length=4))


CHUNKABLE = sorted(set(PARAMS) - {"laq", "kivi", "gear", "zipcache", "commvq", "quest", "retrieval", "sink_window", "topk", "token_select", "recycled_attention", "hip", "tidal_decode", "lserve", "double_sparsity", "shadowkv", "subgen"})


@pytest.mark.parametrize("name", CHUNKABLE)
@pytest.mark.parametrize("question", [0, 8])
def test_left_padded_row_equals_the_row_alone_in_a_chunked_prefill(name, question, llama_file):
    extra = {"question_tokens": question} if question else {}
    _assert_rows_as_alone(name, _params(name, llama_file), prefill_chunk_size=CHUNK, **extra)


@pytest.mark.parametrize("pad, flat", [(13, True), (16, False)])
def test_codec_layers_go_flat_only_when_padding_cuts_a_group(pad, flat):
    """KIVI codes a row in groups of group_size slots from its first token. Padding that is a multiple of
    group_size keeps the batch one rectangle (its groups already start at every row's first token); any other
    padding makes the codec store each row's own groups in flat runs. Either way the row equals itself alone."""
    cache = _assert_rows_as_alone("kivi", PARAMS["kivi"], n_short=LONG - pad)
    assert all(layer.is_flat == flat for _, layer in cache.kvpress_layers())


@pytest.mark.parametrize("name", ["snapkv+kivi", "kivi"])
def test_beam_search_on_a_left_padded_batch_equals_each_row_alone(name, llama_file):
    """Beams reorder and repeat the cache's rows (flat codec runs included): the padded row's beams give the
    sequence it gives alone."""
    model = tiny_model("llama")
    ids, mask, short, pad = _batch()
    run = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, num_beams=3, return_dict_in_generate=True,
               output_scores=True)
    with kvpress.patch_model(model, name, **_params(name, llama_file)), torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, cache=KVPressCache(model.config), **run)
        alone = model.generate(short, attention_mask=torch.ones_like(short),
                               cache=KVPressCache(model.config), **run)
    assert batched.sequences[1, LONG:].tolist() == alone.sequences[0, SHORT:].tolist()
    torch.testing.assert_close(batched.sequences_scores[1], alone.sequences_scores[0], atol=1e-6, rtol=1e-5)
