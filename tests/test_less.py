"""LESS (docs/policies.md 12.11): H2O's eviction plus the evicted tokens' low-rank state. A read is the definition
written here on its own (the feature maps from the paper's formulas, H and z summed over every token not in the
cache, one normaliser for kept and summarised tokens); every evicted token is in the state exactly once; with psi = 0
it is H2O token for token; H2O's training masks keep what H2O keeps; the state's bytes are counted; a calibration
without maps and a serving engine are refused."""

import math

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.formats.calibration import Calibration
from kvpress.integrations.prompts import check_servable
from kvpress.kernels.online_softmax import Queries
from kvpress.less_fit import h2o_masks
from kvpress.policies import Context, LESS

from conftest import greedy, tiny_model


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _phi(q, m, h):
    return _gelu(_gelu(q @ m["q1"][h]) @ m["q2"][h]).abs()


def _psi(k, m, h):
    u = m["scale1"][h].abs() * _gelu(_gelu(k @ m["k1"][h]) @ m["k2"][h])
    return (u + (u @ m["interaction"][h]) * m["scale2"][h]).abs()


def _random_maps(hq=4, hkv=2, d=16, hidden=8, rank=4, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    shapes = dict(q1=(hq, d, hidden), q2=(hq, hidden, rank), k1=(hkv, d, hidden), k2=(hkv, hidden, rank),
                  interaction=(hkv, rank, rank), scale1=(hkv, rank), scale2=(hkv, rank))
    return {name: torch.randn(*shape, generator=g) * scale for name, shape in shapes.items()}


def _calibration(maps, layers=(0,)):
    return Calibration(list(layers), "linear", {}, torch.zeros(len(layers), 2), {},
                       less={name: t[None].expand(len(layers), *t.shape).clone() for name, t in maps.items()})


def test_a_read_is_the_definition_over_kept_and_evicted_tokens():
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    prompt_q = torch.randn(1, 4, 40, 16, generator=g)
    maps = _random_maps()
    policy = LESS(compression_ratio=0.5, maps=_calibration(maps))
    ctx = Context.from_tensors(prompt_q, keys, values)
    policy.observe(ctx)
    policy.on_prefill(ctx)
    layer = ctx.layer
    q = torch.randn(1, 4, 1, 16, generator=g)
    queries = Queries(q, torch.tensor([40]), 16 ** -0.5)
    got = layer.attention(queries, state=policy.prior_state(ctx)(queries))[0, :, 0]
    for hq in range(4):
        h = hq // 2
        kept = layer.key_positions()[0, h][layer.key_valid()[0, h]].long()
        gone = torch.tensor([p for p in range(40) if p not in set(kept.tolist())])
        assert len(kept) == 20 and len(gone) == 20
        e = torch.exp(keys[0, h, kept].double() @ q[0, hq, 0].double() / 4)
        psi = _psi(keys[0, h, gone].double(), {k: v.double() for k, v in maps.items()}, h)
        phi = _phi(q[0, hq, 0].double(), {k: v.double() for k, v in maps.items()}, hq)
        num = (e[:, None] * values[0, h, kept].double()).sum(0) + phi @ (psi.T @ values[0, h, gone].double())
        den = e.sum() + phi @ psi.sum(0)
        assert torch.allclose(got[hq].double(), num / den, atol=1e-5)


def test_every_evicted_token_is_in_the_state_once(llama_file, monkeypatch):
    """Prompt cut and 12 decode steps: z equals the sum of psi over every position the cache no longer holds (the
    keys each forward appended, recorded as they came)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 48), generator=torch.Generator().manual_seed(2))
    appended = {}
    update = kvpress.KVPressLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        appended.setdefault(id(self), []).append(key_states[0].detach().clone())
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(kvpress.KVPressLayer, "update", recording)
    with kvpress.patch_model(model, policy="less", budget=16, calibration=str(llama_file)) as patch:
        cache = kvpress.KVPressCache(model.config)
        greedy(model, ids, 12, cache=cache)
    maps = patch.policy.maps.less
    for layer_idx, layer in cache.kvpress_layers():
        keys = torch.cat(appended[id(layer)], 1).double()  # [Hkv, seen, D], position order
        layer_maps = {name: t[layer_idx].double() for name, t in maps.items()}
        for h in range(layer.num_kv_heads):
            kept = set(layer.key_positions()[0, h][layer.key_valid()[0, h]].tolist())
            gone = [p for p in range(layer.seen) if p not in kept]
            assert len(kept) <= 16 and len(gone) == layer.seen - len(kept) and layer.seen == 59
            expected = _psi(keys[h, gone], layer_maps, h).sum(0)
            assert torch.allclose(layer.policy_stats["less z"][0, h].double(), expected, rtol=1e-4, atol=1e-6)


def test_with_zero_key_features_it_is_h2o():
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 50), generator=torch.Generator().manual_seed(3))
    maps = _random_maps()
    maps["scale1"] = torch.zeros_like(maps["scale1"])  # psi(k) = 0: the state stays empty
    with kvpress.patch_model(model, policy="h2o", budget=20):
        expected = greedy(model, ids, 10)
    with kvpress.patch_model(model, policy=LESS(budget=20, maps=_calibration(maps, (0, 1)))):
        assert torch.equal(greedy(model, ids, 10), expected)


def test_h2o_training_masks_keep_what_h2o_keeps():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, 30, generator=g).masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), -math.inf)
    keep = h2o_masks(logits, 2, heavy=5, recent=3)
    assert bool(keep[:, :8, :8].equal(torch.ones(2, 8, 8, dtype=torch.bool).tril().expand(2, 8, 8)))
    for i in range(8, 30):
        assert bool((keep[:, i, i - 3:i + 1]).all()) and bool((keep[:, i, :i - 3].sum(-1) == 5).all())
        assert not bool(keep[:, i, i + 1:].any())
        if i > 8:  # a token once out never comes back
            assert not bool((keep[:, i, :i - 3] & ~keep[:, i - 1, :i - 3]).any())


def test_the_state_is_counted_in_the_bytes(llama_file):
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 48), generator=torch.Generator().manual_seed(5))
    held = {}
    for policy, extra in (("h2o", {}), ("less", dict(calibration=str(llama_file)))):
        with kvpress.patch_model(model, policy=policy, budget=16, **extra):
            cache = kvpress.KVPressCache(model.config)
            greedy(model, ids, 4, cache=cache)
            held[policy] = cache.nbytes()
    rank, dim, layers, heads = 8, 16, 2, 2
    assert held["less"] - held["h2o"] == layers * heads * rank * (dim + 1) * 4  # H and z, fp32


def test_refusals(llama_file, tmp_path):
    model = tiny_model("llama")
    calibration = Calibration.load(llama_file)
    calibration.less = None
    calibration.save(tmp_path / "no_less.safetensors")
    with pytest.raises(ValueError, match="--less-only"):
        kvpress.patch_model(model, policy="less", compression_ratio=0.5, calibration=str(tmp_path / "no_less.safetensors"))
    with pytest.raises(ValueError, match="summary"):
        check_servable(LESS(compression_ratio=0.5))
