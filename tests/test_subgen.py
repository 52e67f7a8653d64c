"""SubGen (docs/policies.md 12.12): the streaming clustering follows its rule (the C search equals the torch one, and
a hand-made case); reservoirs are uniform samples of their clusters; a read is the estimator N / Z written here on
its own from the sketch's samples; averaged over seeds the estimates meet the exact sums (unbiased); with a budget
that holds the prompt it is the full cache; its bytes are what it holds; bad settings are refused."""

import math

import pytest
import torch

import kvpress
from kvpress.kernels.clusters import cluster_keys, cluster_keys_reference
from kvpress.kernels.online_softmax import Queries
from kvpress.policies import Context, SubGen

from conftest import counter_bytes, greedy, tiny_model


def test_the_c_clustering_equals_the_torch_one():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 150, 8, generator=g)
    for m, t, delta in ((5, 3, [0.0, 2.0, 3.0]), (40, 2, [3.5, 4.0, 100.0]), (1, 4, [1.0] * 3)):
        expected = cluster_keys_reference(keys, m, t, delta, [7, 8, 9])
        got = cluster_keys(keys, m, t, delta, [7, 8, 9])
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_clusters_follow_the_rule_and_reservoirs_hold_their_members():
    # 1-D points: 0, 0.1 join 0; 5 opens; 5.2 joins 5; 9 opens the third (cap 3); 20 is far but the cap makes it join 9
    keys = torch.tensor([0.0, 0.1, 5.0, 5.2, 9.0, 20.0])[None, :, None]
    clusters, assign, counts, reservoir = cluster_keys(keys, 3, 2, [1.0], [0])
    assert clusters.tolist() == [3] and assign.tolist() == [[0, 0, 1, 1, 2, 2]] and counts.tolist() == [[2, 2, 2]]
    assert reservoir.tolist() == [[[0, 1], [2, 3], [4, 5]]]
    keys = torch.randn(2, 400, 4, generator=torch.Generator().manual_seed(1))
    clusters, assign, counts, reservoir = cluster_keys(keys, 20, 5, [1.5, 2.5], [3, 4])
    for h in range(2):
        assert int(counts[h].sum()) == 400 and counts[h, clusters[h]:].sum() == 0
        for c in range(int(clusters[h])):
            members = reservoir[h, c][reservoir[h, c] >= 0]
            assert len(members) == min(5, int(counts[h, c])) and bool((assign[h, members] == c).all())


def test_a_reservoir_is_a_uniform_sample_of_its_cluster():
    """One cluster of 12 keys, a reservoir of 3: over 3000 seeds each key is kept about 3 / 12 of the time."""
    keys = torch.zeros(1, 12, 2)
    hits = torch.zeros(12)
    for seed in range(3000):
        _, _, _, reservoir = cluster_keys(keys, 1, 3, [1.0], [seed])
        hits[reservoir[0, 0]] += 1
    assert torch.allclose(hits / 3000, torch.full((12,), 0.25), atol=0.035)


def _sketch(seed=0, n=90, budget=40, **params):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    query = torch.randn(1, 4, 1, 8, generator=g)
    ctx = Context.from_tensors(query, keys, values, layer_idx=3)
    policy = SubGen(budget=budget, **params)
    policy.on_prefill(ctx)
    return policy, ctx.layer, keys[0], values[0], query


def _estimate(policy, keys, values, q, head, budget, layer_idx=3):
    """SubGen's N / Z for one KV head, from the definition: exact sinks and recent tokens, the clusters' reservoirs
    weighted count / size, the l2 draws weighted sum |v|^2 / (draws |v_j|^2)."""
    n = keys.shape[1]
    sinks, recent = policy.n_sink, policy.recent
    span = torch.arange(sinks, n - recent)
    room = budget - sinks - recent
    draws = math.floor(policy.sample_share * room)
    per = min(policy.cluster_samples, room - draws)
    m = (room - draws) // per
    seed = policy._seed(layer_idx, head)
    k, v = keys[head].double(), values[head].double()
    e = torch.exp(k @ q.double() / math.sqrt(8))
    exact = torch.cat([torch.arange(sinks), torch.arange(n - recent, n)])
    num, den = (e[exact, None] * v[exact]).sum(0), e[exact].sum()
    spread = (k[span] - k[span].mean(0)).square().sum(-1).mean().sqrt()
    _, _, counts, reservoir = cluster_keys_reference(keys[head][span][None], m, per, [policy.radius * float(spread)],
                                                     [seed])
    for c in range(m):
        members = span[reservoir[0, c][reservoir[0, c] >= 0]]
        if len(members):
            den += counts[0, c] / len(members) * e[members].sum()
    norms = v[span].square().sum(-1)
    picks = torch.multinomial((norms / norms.sum()).float().double(), draws, replacement=True,
                              generator=torch.Generator().manual_seed(seed))
    for j in span[picks]:
        num += norms.sum() / (draws * v[j].square().sum()) * e[j] * v[j]
    return num / den


def test_a_read_is_the_estimator_of_the_definition():
    policy, layer, keys, values, query = _sketch(n_sink=2, recent=6)
    queries = Queries(query, torch.tensor([90]), 8 ** -0.5)
    out = layer.attention(queries)[0]  # [Hq, 1, D]
    for hq in range(4):
        expected = _estimate(policy, keys, values, query[0, hq, 0], hq // 2, 40)
        assert torch.allclose(out[hq, 0].double(), expected, atol=1e-5)


def test_the_estimates_are_unbiased():
    """Over 400 seeds, the sketch's denominator and every numerator component average to the exact sums, within
    4 standard errors (and those errors are small: the check has teeth)."""
    g = torch.Generator().manual_seed(5)
    keys, values, q = torch.randn(60, 8, generator=g) * 0.5, torch.randn(60, 8, generator=g), torch.randn(8, generator=g)
    e = torch.exp(keys.double() @ q.double() / math.sqrt(8))
    exact_num, exact_den = (e[:, None] * values.double()).sum(0), e.sum()
    nums, dens = [], []
    for seed in range(400):
        ctx = Context.from_tensors(q.view(1, 1, 1, 8), keys.view(1, 1, 60, 8), values.view(1, 1, 60, 8))
        SubGen(budget=20, n_sink=0, recent=0, seed=seed, cluster_samples=2).on_prefill(ctx)
        sketch = ctx.layer.segments[0]
        data, valid = sketch.data, sketch.valid[0, 0]
        s = torch.exp(data.keys[0, 0].double() @ q.double() / math.sqrt(8)).masked_fill(~valid, 0)
        dens.append(float((data.den_weight[0, 0].double() * s).sum()))
        width = data.values.shape[2]
        nums.append(((data.num_weight[0, 0].double() * s[:width])[:, None] * data.values[0, 0].double()).sum(0))
    dens, nums = torch.tensor(dens, dtype=torch.double), torch.stack(nums)
    for estimates, exact in ((dens, exact_den), (nums, exact_num)):
        error = estimates.std(0) / math.sqrt(len(estimates))
        assert bool(((estimates.mean(0) - exact).abs() < 4 * error).all())
        assert bool((error < 0.2 * exact.abs().max()).all())


def test_a_budget_that_holds_the_prompt_is_the_full_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(2))
    expected = greedy(model, ids, 8)
    with kvpress.patch_model(model, policy="subgen", budget=40):
        assert torch.equal(greedy(model, ids, 8), expected)


def test_bytes_held_are_the_samples_and_their_weights():
    policy, layer, *_ = _sketch(n_sink=2, recent=6)
    sketch = layer.segments[0]
    batch, heads, width, dim = sketch.data.keys.shape
    with_value = sketch.data.values.shape[2]
    assert width <= 40 and with_value < width  # cluster samples hold no value
    expected = 4 * (heads * width * dim + heads * with_value * dim + heads * with_value + heads * width) + \
        heads * width * 4 + heads * width  # keys, values, num / den weights (fp32), int32 positions, validity
    assert layer.nbytes() == expected + counter_bytes(layer)
    assert int(sketch.valid.sum(-1).max()) <= 40


def test_bad_settings_are_refused_before_anything_changes():
    model = tiny_model("llama")
    for params, word in ((dict(sample_share=1.5), "sample_share"), (dict(radius=-1.0), "radius"),
                         (dict(cluster_samples=0), "cluster_samples"), (dict(recent=-1), "recent")):
        with pytest.raises(ValueError, match=word):
            kvpress.patch_model(model, policy="subgen", compression_ratio=0.5, **params)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        kvpress.patch_model(model, policy="subgen", compression_ratio=0.5, prefill_chunk_size=16)
    for composed in ("subgen+kivi", "snapkv+subgen"):
        with pytest.raises(ValueError):
            kvpress.patch_model(model, policy=composed, compression_ratio=0.5)
