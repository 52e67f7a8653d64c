"""A context every row shares (cache/prefix.py, issue 52): held once whatever the number of questions, read once for
all rows and merged with each row's own slots, exactly the read of the same context copied into every row; a step
that reads or changes the whole view gives each row its own copy first (copy on write)."""

import pytest
import torch

import kvpress
from kvpress.integrations.scoped import patched_for_call
from kvpress.questions import left_padded

from conftest import reachable_storage_bytes, tiny_model
from test_compressed import CONTEXT, QUESTIONS, STORAGE, TOK

KINDS = {**STORAGE,
         "commvq": ("commvq", dict(key_stages=2, value_stages=3, block_size=16, residual_length=16)),
         "kvzap+commvq": ("kvzap+commvq", dict(compression_ratio=0.5, key_stages=2, block_size=16,
                                               residual_length=16))}


def compressed_context(kind, calibration, arch="llama"):
    policy, params = KINDS[kind]
    if "commvq" in policy:
        params = dict(params, calibration=str(calibration))
    return kvpress.compress(tiny_model(arch), TOK, CONTEXT, policy, **params)


def rows_of(compressed, questions=QUESTIONS, shared=True, tokenizer=TOK, pad=0):
    """A fork of the context for one row per question: shared (the context once), or copied into every row."""
    cache = compressed.fork()
    cache.share_context()
    cache.batch_repeat_interleave(len(questions))
    if not shared:
        for _, layer in cache.kvpress_layers():
            layer.unshare()
    ids = [compressed.question_format.ids(tokenizer, q) for q in questions]
    return (cache, *left_padded(compressed.context_ids, ids, pad))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_shared_read_equals_the_replicated_read_over_every_storage_kind(kind, llama_file):
    """Full precision (rectangular, flat runs), low-bit (KIVI, GEAR, two widths, flat runs), CommVQ: the questions'
    forward over the shared context gives the logits of the same forward over the context copied into each row."""
    compressed = compressed_context(kind, llama_file)
    logits = {}
    for shared in (True, False):
        cache, ids, mask = rows_of(compressed, shared=shared)
        with patched_for_call(compressed.model, compressed.make_policy(TOK)), torch.no_grad():
            logits[shared] = compressed.model(ids, attention_mask=mask, cache=cache).logits[:, -1]
        if shared and "decode_eviction" not in kind:  # h2o reads the whole view: it copies at once
            assert all(layer.prefix is not None for _, layer in cache.kvpress_layers())
    torch.testing.assert_close(logits[True], logits[False], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["evicted", "low_bit", "flat_low_bit", "commvq"])
def test_the_context_is_held_once_whatever_the_number_of_rows(kind, llama_file):
    """Eight rows over a shared context hold the context's bytes once (a copy per row before), plus each row's own
    question and answer; nbytes() accounts for every allocation the cache object reaches."""
    compressed = compressed_context(kind, llama_file)
    one = compressed.nbytes()
    cache, _, _ = rows_of(compressed, QUESTIONS * 3)
    assert cache.nbytes() <= 1.01 * one  # (the rows' counters: [B] padding and budget)
    assert reachable_storage_bytes(cache) == cache.nbytes() + cache.shared_nbytes()
    answers = compressed.ask(TOK, QUESTIONS * 3, max_new_tokens=6)
    alone = [compressed.ask(TOK, q, max_new_tokens=6) for q in QUESTIONS]
    # each row holds its question (padded to the longest) and answer: at most what the longest holds alone
    own = max(a.batch_bytes for a in alone) - one
    assert answers.context_bytes == one and answers.batch_bytes <= one + 9 * own * 1.05
    assert answers.token_ids == [a.token_ids[0] for a in alone] * 3


@pytest.mark.parametrize("policy,params", [("h2o", dict(compression_ratio=0.5)), ("tova", dict(compression_ratio=0.5)),
                                           ("streaming_llm", dict(compression_ratio=0.5)),
                                           ("quest", dict(budget=24, page_size=8))])
def test_a_step_that_reads_the_whole_view_copies_the_context_into_each_row(policy, params):
    """Evicting per row while decoding (h2o, tova, streaming_llm), or reading a selection (quest): the first such
    step gives each row its own copy of the context, and says so in stats(); the answers are those of the context
    copied into every row from the start, and of each question asked alone."""
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, policy, **params)
    out = {}
    for shared in (True, False):
        cache, ids, mask = rows_of(compressed, shared=shared)
        with patched_for_call(model, compressed.make_policy(TOK)), torch.no_grad():
            out[shared] = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, min_new_tokens=8,
                                         do_sample=False)
        if shared:
            assert all(row["copied_on_write"] and row["shared_slots"] == 0 for row in cache.stats())
    assert torch.equal(out[True], out[False])
    batched = compressed.ask(TOK, QUESTIONS, max_new_tokens=8).token_ids
    assert batched == [compressed.ask(TOK, q, max_new_tokens=8).token_ids[0] for q in QUESTIONS]


def test_speculation_over_a_shared_context_equals_greedy_over_it():
    """A draft reads a selection of the view: its first round copies the context into the row; the tokens are plain
    greedy's over the same compressed context."""
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, "snapkv", compression_ratio=0.5)
    ids = torch.cat([compressed.context_ids, torch.tensor([compressed.question_format.ids(TOK, QUESTIONS[2])])], 1)
    plain, _, _ = rows_of(compressed, QUESTIONS[:1])
    with patched_for_call(model, compressed.make_policy(TOK)), torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=plain, max_new_tokens=16,
                                  min_new_tokens=16, do_sample=False)
    drafted, _, _ = rows_of(compressed, QUESTIONS[:1])
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):
        got = kvpress.speculative_generate(model, ids, cache=drafted, draft="sink_window", draft_budget=16, gamma=3,
                                           max_new_tokens=16, eos_token_id=[])
    assert torch.equal(got, expected)


def test_a_cache_whose_rows_share_a_context_is_not_saved_and_is_shared_once():
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, "snapkv", compression_ratio=0.5)
    cache, _, _ = rows_of(compressed)
    from kvpress.cache.saving import to_tensors
    with pytest.raises(ValueError, match=r"cache: its rows share a context"):
        to_tensors(cache)
    before = cache.nbytes()
    cache.share_context()  # again: nothing changes
    assert cache.nbytes() == before and all(layer.prefix is not None for _, layer in cache.kvpress_layers())


@pytest.mark.real_model
def test_smollm2_shared_and_replicated_contexts_give_the_same_tokens(smollm2):
    """kvzap at 0.75 over a 1K-token context, four questions at once: greedy tokens identical to the context copied
    into every row (the replicated read), and to each question asked alone."""
    model, tokenizer = smollm2
    compressed = kvpress.compress(model, tokenizer, CONTEXT * 10, "kvzap", compression_ratio=0.75)
    questions = ["Who founded the cooperative?", "What is the mascot called?", "When was it founded?", "Who?"]
    out = {}
    for shared in (True, False):
        cache, x, mask = rows_of(compressed, questions, shared, tokenizer, tokenizer.pad_token_id or 0)
        with patched_for_call(model, compressed.make_policy(tokenizer)), torch.no_grad():
            out[shared] = model.generate(x, attention_mask=mask, cache=cache, max_new_tokens=16, min_new_tokens=16,
                                         do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    assert torch.equal(out[True], out[False])
    answers = compressed.ask(tokenizer, questions, max_new_tokens=16)
    assert answers.token_ids == [compressed.ask(tokenizer, q, max_new_tokens=16).token_ids[0] for q in questions]


@pytest.mark.parametrize("policy,params", [("kivi", dict(bits=4, group_size=16, residual_length=16)),
                                           ("snapkv+kivi", dict(compression_ratio=0.5, bits=2, group_size=8,
                                                                residual_length=8))])
def test_a_codec_flushing_while_answering_gives_each_row_its_logits_alone(policy, params):
    """The rows' answers outgrow the codec's window, so their tokens are coded while they answer: each row's groups
    start at its own first token whatever the padding before it (when the rows held the context themselves, a
    rectangular flush cut every row's groups at the same slot, padding included: SmolLM2's kvzap+kivi answers
    differed from asking alone). Logits at every step equal the question asked alone."""
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, policy, **params)
    questions = ["Who?", "What is the name of the mascot, exactly?", "When was it founded, by whom, and where?"]
    run = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def logits(qs):
        cache, ids, mask = rows_of(compressed, qs)
        with patched_for_call(model, compressed.make_policy(TOK)), torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, **run)
        assert any(layer.codes for _, layer in cache.kvpress_layers())  # the rows' own tokens were coded
        return torch.stack(out.logits, 1)  # [rows, steps, vocab]

    batched = logits(questions)
    for row, question in enumerate(questions):
        torch.testing.assert_close(batched[row], logits([question])[0], atol=1e-4, rtol=1e-4)
