"""kvpress.combine (issue 52, part 4): several contexts compressed apart, answered as one, checked against their
definitions written out here with the stock model: APE at temperature 1 and scale 1 is plain parallel encoding;
APE's tempered read is its three-way log-sum-exp mix; CacheBlend with every token recomputed is the concatenation's
prefill; positions and re-rotated keys are where each method puts them."""

import math

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.cache import KVPressLayer
from kvpress.cache.prefix import ParallelPrefix
from kvpress.cache.read import attention_state
from kvpress.kernels.online_softmax import Queries, finish
from kvpress.positions import Rotary, rotate_keys

from conftest import tiny_model
from test_compressed import CharTokenizer

DOCS = ["Alpha beta gamma delta epsilon zeta eta theta.", "Zebra yak xenops wombat vole urial tapir.",
        "1 2 3 4 5 6 7 8 9 10 11 12 13"]
QUESTION = "Question: which animal?"


class NoSpecialTokens(CharTokenizer):
    """No BOS: documents that share no first token (APE without a shared prefix)."""

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 120 for c in text]


TOK = NoSpecialTokens()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def stock_cache(model, ids_list, positions_list):
    """A DynamicCache holding, per layer, the stock model's keys/values of each id row computed alone at its positions,
    concatenated."""
    caches = []
    with torch.no_grad():
        for ids, positions in zip(ids_list, positions_list):
            c = DynamicCache(config=model.config)
            model(torch.tensor([ids]), position_ids=torch.tensor([positions]), cache=c)
            caches.append(c)
    out = DynamicCache(config=model.config)
    for i in range(model.config.num_hidden_layers):
        out.update(torch.cat([c.layers[i].keys for c in caches], 2), torch.cat([c.layers[i].values for c in caches], 2),
                   i)
    return out


def stock_greedy(model, cache, ids, first_position, n):
    """Greedy tokens of the stock model after `cache`, the first at RoPE position `first_position` (every cached
    slot visible to every query)."""
    held, out, x, position = cache.get_seq_length(), [], torch.tensor([ids]), first_position
    with torch.no_grad():
        for _ in range(n):
            logits = model(x, cache=cache, position_ids=torch.arange(position, position + x.shape[1])[None],
                           attention_mask=torch.ones(1, held + x.shape[1], dtype=torch.long)).logits[:, -1]
            held, position = held + x.shape[1], position + x.shape[1]
            out.append(int(logits.argmax(-1)))
            x = torch.tensor([[out[-1]]])
    return out


def test_ape_at_temperature_1_and_scale_1_is_plain_parallel_encoding(llama):
    """Each document encoded alone from position 0 (no shared prefix), their keys and values side by side, the
    question after the longest: what APE keeps, and the stock model's greedy answer over exactly that."""
    contexts = [kvpress.compress(llama, TOK, d, "none") for d in DOCS]
    combined = kvpress.combine(contexts, method="ape")
    lengths = [c.context_tokens for c in contexts]
    assert combined.cache.get_seq_length() == max(lengths)
    got = combined.ask(TOK, QUESTION, max_new_tokens=8).token_ids[0]
    ids = [TOK.encode(d) for d in DOCS]
    reference = stock_cache(llama, ids, [list(range(len(i))) for i in ids])
    expected = stock_greedy(llama, reference, combined.question_format.ids(TOK, QUESTION), max(lengths), 8)
    assert got == expected[:len(got)]


def test_ape_s_tempered_read_is_its_three_way_log_sum_exp_mix():
    """APE's query attention, written out: softmax over the instruction's logits, over the documents' logits / T, and
    over the rows' own; the three mixed by softmax([lse_inst, T * lse(docs / T) + log S, lse_own])."""
    torch.manual_seed(0)
    heads, dim, T, S = 2, 8, 0.7, 0.8

    def layer(n, first):
        out = KVPressLayer()
        out.update(torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim))
        out.seen = first + n  # positions first .. first + n - 1 (explicit below)
        out.tail.positions = torch.arange(first, first + n, dtype=torch.int32).expand(1, heads, n).clone()
        out.explicit_positions = True
        return out

    instruction, docs = layer(5, 0), (layer(7, 5), layer(4, 5))  # the documents at the same positions
    own = layer(3, 12)
    prefix = ParallelPrefix(instruction, docs, 5, T, S)
    q = torch.randn(1, heads * 2, 1, dim)
    queries = Queries(q, torch.tensor([15]), dim ** -0.5)
    state = prefix.state(queries, attention_state)
    got = finish(attention_state(own, queries, state=state), queries)

    def logits_values(parts):
        keys = torch.cat([p.tail.data.keys for p in parts], 2).repeat_interleave(2, 1)
        values = torch.cat([p.tail.data.values for p in parts], 2).repeat_interleave(2, 1)
        return (q @ keys.transpose(-1, -2)) * dim ** -0.5, values

    (li, vi), (ld, vd), (lo, vo) = logits_values([instruction]), logits_values(docs), logits_values([own])
    lse = torch.stack([li.logsumexp(-1), T * (ld / T).logsumexp(-1) + math.log(S), lo.logsumexp(-1)], -1)
    weight = lse.softmax(-1)
    mixed = (weight[..., 0:1] * (li.softmax(-1) @ vi) + weight[..., 1:2] * ((ld / T).softmax(-1) @ vd)
             + weight[..., 2:3] * (lo.softmax(-1) @ vo))
    torch.testing.assert_close(got, mixed, atol=1e-5, rtol=1e-5)


def test_cacheblend_recomputing_every_token_is_the_concatenation_s_prefill(llama):
    contexts = [kvpress.compress(llama, TOK, d, "none") for d in DOCS]
    combined = kvpress.combine(contexts, method="cacheblend", recompute=1.0)
    whole = kvpress.compress(llama, TOK, "".join(DOCS), "none")
    assert combined.cache.get_seq_length() == whole.context_tokens
    assert torch.equal(combined.context_ids, whole.context_ids)
    for (_, a), (_, b) in zip(combined.cache.kvpress_layers(), whole.cache.kvpress_layers()):
        order = a.key_positions()[0, 0].argsort()
        assert torch.equal(a.key_positions()[0, 0][order], b.key_positions()[0, 0].int())
        torch.testing.assert_close(a.keys_view()[0][:, order], b.keys_view()[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values_view()[0][:, order], b.values_view()[0], atol=1e-5, rtol=1e-5)
    assert combined.ask(TOK, QUESTION, max_new_tokens=8).token_ids == whole.ask(TOK, QUESTION,
                                                                                   max_new_tokens=8).token_ids


def test_positions_and_keys_are_where_each_method_puts_them(llama):
    """APE: every document where it was encoded. CacheBlend: document k after the documents before it, its keys
    rotated by that many positions (in the first layer every token's, recomputed or not: a first layer's key is its
    token's at its position)."""
    contexts = [kvpress.compress(llama, TOK, d, "snapkv", compression_ratio=0.5) for d in DOCS]
    lengths = [c.context_tokens for c in contexts]
    ape = kvpress.combine(contexts, method="ape")
    for i, layer in ape.cache.kvpress_layers():
        for doc, context in zip(layer.prefix.documents, contexts):
            original = context.cache.layers[i]
            assert sorted(doc.key_positions()[doc.key_valid()].tolist()) == \
                sorted(original.key_positions()[original.key_valid()].tolist())
    blended = kvpress.combine(contexts, method="cacheblend", recompute=0.05)
    rotary = Rotary.of(llama, kvpress.integrations.hf.attention_modules_of(llama)[0])
    layer = blended.cache.layers[0]
    positions, keys = layer.key_positions()[0], layer.keys_view()[0]
    for k, context in enumerate(contexts):
        original = context.cache.layers[0]
        shift = sum(lengths[:k])
        for h in range(positions.shape[0]):
            mine = original.key_positions()[0, h][original.key_valid()[0, h]]
            where = torch.isin(positions[h], mine + shift)
            assert int(where.sum()) == mine.numel()  # every kept token, moved by `shift`
            expected = rotate_keys(original.keys_view()[0, h][original.key_valid()[0, h]][None, None],
                                   torch.full((1, 1, mine.numel()), shift), rotary.inv_freq())[0, 0]
            torch.testing.assert_close(keys[h][where], expected, atol=1e-5, rtol=1e-5)


def test_combine_from_saved_files_answers_as_from_memory(llama, tmp_path):
    contexts = [kvpress.compress(llama, TOK, d, "keydiff", compression_ratio=0.5) for d in DOCS]
    loaded = [kvpress.load(c.save(tmp_path / f"d{i}.kvpress"), llama) for i, c in enumerate(contexts)]
    for method in ("ape", "cacheblend"):
        assert kvpress.combine(loaded, method=method).ask(TOK, QUESTION, max_new_tokens=6).token_ids == \
            kvpress.combine(contexts, method=method).ask(TOK, QUESTION, max_new_tokens=6).token_ids


def test_the_rows_of_a_combined_context_share_it():
    model = tiny_model("llama")
    contexts = [kvpress.compress(model, TOK, d, "keydiff", compression_ratio=0.5) for d in DOCS]
    combined = kvpress.combine(contexts, method="ape", temperature=0.8, scale=0.9)
    questions = [QUESTION, "Which number?", "Who?"]
    batched = combined.ask(TOK, questions, max_new_tokens=6)
    assert batched.token_ids == [combined.ask(TOK, q, max_new_tokens=6).token_ids[0] for q in questions]
    assert batched.context_bytes == combined.nbytes() <= sum(c.nbytes() for c in contexts)
    assert combined.full_cache_nbytes() == sum(c.full_cache_nbytes() for c in contexts)  # (no shared prefix here)


@pytest.mark.parametrize("case,match", [
    ("one", r"contexts=list; allowed values: a list of two or more CompressedContext"),
    ("method", r"method='blend'; allowed values: \['ape', 'cacheblend'\]"),
    ("temperature", r"temperature=0; allowed values: a finite number > 0"),
    ("recompute", r"recompute=1.5; allowed values: a fraction in \(0, 1\]"),
    ("policy", r"contexts\[1\]: another policy than contexts\[0\]'s"),
    ("tokenizer", r"contexts\[1\]: another tokenizer"),
    ("model", r"contexts\[1\]: compressed with another model"),
    ("h2o", r"method='ape': h2o\(.*\) reads the whole cache"),
    ("kivi", r"method='cacheblend' re-rotates and recomputes stored keys"),
    ("gemma", r"sliding-window layers"),
])
def test_combine_refuses_what_it_cannot_join(case, match, llama):
    def context(text, policy="snapkv", model=llama, tokenizer=TOK, **params):
        params = params or (dict(compression_ratio=0.5) if policy in ("snapkv", "h2o") else {})
        return kvpress.compress(model, tokenizer, text, policy, **params)

    class Other(NoSpecialTokens):
        def encode(self, text, add_special_tokens=False):
            return [4 + ord(c) % 110 for c in text]

    a, b = context(DOCS[0]), context(DOCS[1])
    kwargs = {}
    if case == "one":
        b = None
    elif case == "method":
        kwargs = dict(method="blend")
    elif case == "temperature":
        kwargs = dict(temperature=0)
    elif case == "recompute":
        kwargs = dict(method="cacheblend", recompute=1.5)
    elif case == "policy":
        b = context(DOCS[1], "keydiff", compression_ratio=0.5)
    elif case == "tokenizer":
        b = context(DOCS[1], tokenizer=Other())
    elif case == "model":
        b = context(DOCS[1], model=tiny_model("llama", seed=1))
    elif case == "h2o":
        a, b = context(DOCS[0], "h2o"), context(DOCS[1], "h2o")
    elif case == "kivi":
        kivi = dict(bits=4, group_size=16, residual_length=16)
        a, b = context(DOCS[0], "kivi", **kivi), context(DOCS[1], "kivi", **kivi)
        kwargs = dict(method="cacheblend")
    elif case == "gemma":
        gemma = tiny_model("gemma3")
        a, b = context(DOCS[0], model=gemma), context(DOCS[1], model=gemma)
    with pytest.raises(ValueError, match=match):
        kvpress.combine([a] if b is None else [a, b], **kwargs)
