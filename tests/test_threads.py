"""One model used from several threads at once (issue 55, class 3). The one-call API (compress, ask,
speculative_generate) patches an unpatched model for its own calls only (integrations/scoped.py): calls that need
the same policy share that patch, calls that need another wait for it, and every other thread meanwhile runs the
model unpatched. Every result equals the single-threaded one; afterwards the model is as it was."""

import threading

import pytest
import torch

import kvpress

from conftest import greedy, tiny_model
from test_compressed import CONTEXT, QUESTIONS, TOK
from test_errors import untouched

ROUNDS = 3


def run_together(*jobs):
    """Run the jobs on threads started together; returns the exceptions they raised (repr)."""
    start = threading.Barrier(len(jobs))
    errors = []

    def run(job):
        start.wait()
        try:
            job()
        except Exception as e:  # noqa: BLE001 - the test reports every failure
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def prompt(n=40, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_plain_generate_runs_unpatched_while_another_thread_speculates():
    """A plain generate (stock cache) on one thread while speculative_generate patches the model for itself on
    another: it raised "cache=DynamicCache: a kvpress-patched model compresses only a KVPressCache"."""
    model = tiny_model("llama")
    ids = prompt()
    expected = greedy(model, ids, 24)
    plain, drafted = [], []

    def generate_plainly():
        for _ in range(ROUNDS * 2):
            plain.append(greedy(model, ids, 24))

    def speculate():
        for _ in range(ROUNDS):
            drafted.append(kvpress.speculative_generate(model, ids, draft="sink_window", draft_budget=16, gamma=3,
                                                        max_new_tokens=24, eos_token_id=[]))

    assert run_together(generate_plainly, speculate) == []
    assert all(torch.equal(out, expected) for out in plain + drafted) and len(plain + drafted) == 3 * ROUNDS
    assert untouched(model)


def test_a_plain_generate_runs_unpatched_while_another_thread_asks():
    model = tiny_model("llama")
    ids = prompt()
    expected = greedy(model, ids, 16)
    compressed = kvpress.compress(model, TOK, CONTEXT, "snapkv+kivi", compression_ratio=0.5, bits=4, group_size=16,
                                  residual_length=16)
    alone = compressed.ask(TOK, QUESTIONS, max_new_tokens=8).token_ids
    plain, asked = [], []

    def generate_plainly():
        for _ in range(ROUNDS):
            plain.append(greedy(model, ids, 16))

    def ask():
        for _ in range(ROUNDS):
            asked.append(compressed.ask(TOK, QUESTIONS, max_new_tokens=8).token_ids)

    assert run_together(generate_plainly, ask) == []
    assert all(torch.equal(out, expected) for out in plain) and asked == [alone] * ROUNDS
    assert untouched(model)


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_asking_one_context_get_the_single_threaded_answers(threads):
    """Two threads asking one CompressedContext failed 6 times in 6 with "model is already patched"."""
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, "keydiff", compression_ratio=0.5)
    alone = [compressed.ask(TOK, QUESTIONS, max_new_tokens=8).token_ids,
             compressed.ask(TOK, QUESTIONS[:1], max_new_tokens=8).token_ids]
    got = [[] for _ in range(threads)]

    def ask(i):
        for _ in range(ROUNDS):
            got[i].append(compressed.ask(TOK, QUESTIONS if i % 2 == 0 else QUESTIONS[:1], max_new_tokens=8).token_ids)

    assert run_together(*[lambda i=i: ask(i) for i in range(threads)]) == []
    assert all(got[i] == [alone[i % 2]] * ROUNDS for i in range(threads))
    assert untouched(model)


def test_threads_compressing_and_asking_under_different_policies_each_get_their_own():
    """Calls that need different policies take turns on the model (the second waits for the first's patch to come
    off): each gets what it gets alone."""
    model = tiny_model("llama")
    specs = [("snapkv", dict(compression_ratio=0.5)), ("keydiff+kivi", dict(compression_ratio=0.5, bits=4,
                                                                            group_size=16, residual_length=16)),
             ("tova", dict(compression_ratio=0.75))]
    alone = [kvpress.ask(model, TOK, CONTEXT, QUESTIONS, policy, max_new_tokens=8, **params).token_ids
             for policy, params in specs]
    got = [[] for _ in specs]

    def run(i):
        policy, params = specs[i]
        for _ in range(ROUNDS):
            got[i].append(kvpress.ask(model, TOK, CONTEXT, QUESTIONS, policy, max_new_tokens=8, **params).token_ids)

    assert run_together(*[lambda i=i: run(i) for i in range(len(specs))]) == []
    assert got == [[a] * ROUNDS for a in alone]
    assert untouched(model)


def test_a_model_the_caller_patched_is_not_patched_again_by_ask():
    model = tiny_model("llama")
    compressed = kvpress.compress(model, TOK, CONTEXT, "snapkv", compression_ratio=0.5)
    with kvpress.patch_model(model, "h2o", compression_ratio=0.5):
        with pytest.raises(ValueError, match=r"model is already patched by kvpress with h2o\(.*\) \(its caller's "
                                             r"patch\); allowed: an unpatched model"):
            compressed.ask(TOK, QUESTIONS, max_new_tokens=4)
    assert untouched(model)
