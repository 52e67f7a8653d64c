"""Random parameter combinations for every registered policy (and the compositions), as a hostile user would pass
them (issue 30): each is either refused with a clear ValueError (naming a parameter and the allowed values) before
anything changes, or runs: generate gives tokens of the vocabulary for every row of a left-padded batch, every layer
has seen the tokens it was given and holds between one and that many per head, the bytes it reports are the bytes
its tensors hold, and unpatch leaves the model as it was. Any other exception fails. Draws are seeded per policy."""

import dataclasses
import math
import random
import zlib

import pytest
import torch

import kvpress
from kvpress import KVPressCache
from kvpress.policies import get_policy_class

from conftest import reachable_storage_bytes, tiny_model
from test_errors import untouched
from test_padding import COMPOSED, PARAMS, _params

TRIALS = 12
NEW = 4
POOLS = {  # values of every kind, valid and not, per annotated kind of a hyper-parameter
    "int": [-5, -1, 0, 1, 2, 3, 4, 7, 8, 16, 33, 100, 10_000, True, 2.5, "8", None],
    "float": [-0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.999, 1.0, 1.5, 25.0, math.nan, math.inf, 3, "0.5", None, True],
    "bool": [True, False, 0, 1, "yes", None],
    "str": ["bogus", "", 7, None, "uniform", "pyramid", "adaptive", "global", "max", "avg"],
}


def _fields(cls) -> dict:
    """name -> pool of the hyper-parameters of `cls` (or of a composition's parts) whose annotation is plain."""
    out = {}
    for f in dataclasses.fields(cls):
        text = f.type.__name__ if isinstance(f.type, type) else str(f.type)
        kinds = [k.strip() for k in text.split("|") if k.strip() != "None"]
        if len(kinds) == 1 and kinds[0] in POOLS:
            out[f.name] = POOLS[kinds[0]]
    return out


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 72), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(PARAMS) + sorted(COMPOSED))
def test_random_parameters_are_refused_cleanly_or_run_sanely(name, llama_file):
    rng = random.Random(zlib.crc32(name.encode()))
    pools = {}
    for part in name.split("+"):
        pools.update(_fields(get_policy_class(part)))
    model = tiny_model("llama")
    ids, mask = _batch()
    outcomes = {"refused": 0, "ran": 0}
    for _ in range(TRIALS):
        params = _params(name, llama_file)
        changed = rng.sample(sorted(pools), k=min(len(pools), rng.randint(1, 3)))
        for field in changed:
            params[field] = rng.choice(pools[field])
        try:
            patch = kvpress.patch_model(model, name, **params)
        except ValueError as e:
            message = str(e)
            assert "allowed" in message and any(field in message for field in [*params, "policy", "model"]), message
            assert untouched(model), params
            outcomes["refused"] += 1
            continue
        with patch, torch.no_grad():
            cache = KVPressCache(model.config)
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False)
        assert out.shape == (2, ids.shape[1] + NEW) and bool(((out >= 0) & (out < 128)).all()), params
        for _, layer in cache.kvpress_layers():
            held = layer.tokens_per_head()
            assert layer.seen == ids.shape[1] + NEW - 1, params
            assert bool((held >= 1).all()) and bool((held <= layer.seen).all()), params
            valid = layer.key_valid()
            assert bool(torch.isfinite(layer.keys_view()[valid]).all()), params  # no NaN stored
            assert bool(torch.isfinite(layer.values_view()[valid]).all()), params
        budgeted = [(layer.tokens_per_head().float().mean(-1), layer.row_budget) for _, layer in cache.kvpress_layers()
                    if layer.row_budget is not None]
        if budgeted:  # the budgets the policy declared (per layer, or spread over layers): never more than they
            kept = sum(k for k, _ in budgeted)  # allow, plus what decoding added
            assert bool((kept <= sum(b for _, b in budgeted) + NEW * len(budgeted)).all()), (params, budgeted)
        # every allocation the cache object reaches is in nbytes (or the model's shared tables, or a file tier)
        assert cache.nbytes() + cache.shared_nbytes() == reachable_storage_bytes(cache) - cache.offloaded_nbytes(), \
            params
        assert untouched(model), params
        outcomes["ran"] += 1
    assert outcomes["ran"] + outcomes["refused"] == TRIALS
