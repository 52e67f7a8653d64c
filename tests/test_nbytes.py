"""What a cache reports it holds is what it holds (issue 55, class 2): after a left-padded generate under every
registered policy and composition, with and without a capture reserve, nbytes() plus the model-level tables it reads
(shared_nbytes: CommVQ's codebooks, a calibration's channels) equals the distinct allocations reachable from the
cache object (found by walking it, not by asking it), less a file tier (offloaded_nbytes)."""

import pytest
import torch

import kvpress
from kvpress import KVPressCache

from conftest import reachable_storage_bytes, tiny_model
from test_compressed import CONTEXT, TOK
from test_fuzz import _batch
from test_padding import COMPOSED, PARAMS, _params


def generated(name, params, **cache_kwargs):
    model = tiny_model("llama")
    ids, mask = _batch()
    with kvpress.patch_model(model, name, **params), torch.no_grad():
        cache = KVPressCache(model.config, **cache_kwargs)
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    return cache


def accounted(cache) -> tuple[int, int]:
    return cache.nbytes() + cache.shared_nbytes(), reachable_storage_bytes(cache) - cache.offloaded_nbytes()


@pytest.mark.parametrize("name", sorted(PARAMS) + sorted(COMPOSED))
def test_nbytes_accounts_for_every_allocation_the_cache_holds(name, llama_file):
    reported, held = accounted(generated(name, _params(name, llama_file)))
    assert reported == held


@pytest.mark.parametrize("name", ["none", "snapkv", "kivi", "quest", "h2o"])
def test_a_capture_reserve_is_counted(name, llama_file):
    params = _params(name, llama_file)
    if name == "h2o":
        params["slack"] = 2
    cache = generated(name, params, capture_reserve=8)
    reported, held = accounted(cache)
    assert reported == held and any(row["reserved_slots"] > 0 for row in cache.stats())


def test_codebooks_are_shared_tables_not_the_caches_bytes(llama_file):
    """CommVQ's codes read the model's codebooks: reported once in shared_nbytes (the same for two caches), never in
    nbytes (which holds the codes)."""
    params = _params("commvq", llama_file)
    a, b = generated("commvq", params), generated("commvq", params)
    assert a.shared_nbytes() > 10 * a.nbytes() and a.shared_nbytes() == b.shared_nbytes()
    assert generated("kivi", _params("kivi", llama_file)).shared_nbytes() == 0
    model = tiny_model("llama")
    with kvpress.patch_model(model, "commvq", **params), torch.no_grad():
        model.generate(*_batch()[:1], max_new_tokens=2, do_sample=False)
    stats = kvpress.last_cache_stats(model)
    assert stats["shared_bytes"] > 10 * stats["bytes"]
    answers = kvpress.ask(model, TOK, CONTEXT, ["Who?"], "commvq", max_new_tokens=2, **params)
    assert answers.shared_bytes > 10 * answers.context_bytes > 0
