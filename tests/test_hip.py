"""HiP reads what its definition (docs/policies.md 12.5, v1.1) names: a row's first n_sink and last `window` slots,
and the nodes a hierarchical search keeps in between (halve every node, score each half by the block of keys at its
centre, keep the best k / block_size halves, until nodes span at most block_size slots). Checked against the exact
top-k where the search is exact (scores unimodal in position), and round by round against a plain-Python search."""

import math

import pytest
import torch

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.policies import Context, HiP
from kvpress.policies.hip import hierarchical_search

from conftest import greedy, tiny_model


def _read(policy, keys, query):
    layer = KVPressLayer()
    layer.update(keys, torch.randn_like(keys))
    idx, valid = policy.select(Context(layer_idx=0, layer=layer, phase="decode", query=query, scaling=1.0))
    return [[set(idx[b, h][valid[b, h]].tolist()) for h in range(idx.shape[1])] for b in range(idx.shape[0])]


def _search_by_hand(q, keys, first, last, nodes, block):
    """The search for one head, in plain Python: q [r, D], keys [T, D]. Returns (kept slots, rounds)."""
    n_blocks = -(-(last - first) // block)
    bounds = [n_blocks * i // nodes for i in range(nodes + 1)]
    parts, rounds = list(zip(bounds[:-1], bounds[1:])), 0
    while any(e - s > 1 for s, e in parts):
        halves = [(s, (s + e) // 2) for s, e in parts] + [((s + e) // 2, e) for s, e in parts]
        scored = []
        for i, (s, e) in enumerate(halves):
            centre = first + (s + e) // 2 * block
            block_keys = keys[centre:min(centre + block, last)]
            scored.append((float((q @ block_keys.T).max()) if e > s else -math.inf, i))
        parts = [halves[i] for _, i in sorted(scored, key=lambda t: (-t[0], t[1]))[:nodes]]
        rounds += 1
    return {j for s, e in parts for j in range(first + s * block, min(first + e * block, last))}, rounds


@pytest.mark.parametrize("length,nodes,block", [(200, 8, 2), (333, 5, 4), (64, 16, 1), (1000, 12, 3)])
def test_the_search_keeps_what_the_rounds_written_out_keep(length, nodes, block):
    torch.manual_seed(length)
    keys, q = torch.randn(1, 1, length, 8), torch.randn(1, 1, 2, 8)
    first, last = torch.tensor([[3]]), torch.tensor([[length - 5]])
    start, end, rounds = hierarchical_search(q, keys, first, last, nodes, block)
    found = {j for s, e in zip(start[0, 0].tolist(), end[0, 0].tolist()) for j in range(s, e)}
    expected, expected_rounds = _search_by_hand(q[0, 0], keys[0, 0], 3, length - 5, nodes, block)
    assert found == expected and rounds == expected_rounds
    # about log2(range / k) rounds (the halves of an odd node differ by a block: the kept ones may end a round early)
    n_blocks = math.ceil((length - 8) / block)
    assert math.floor(math.log2(n_blocks / nodes)) <= rounds <= math.ceil(math.log2(n_blocks / nodes))


def test_on_scores_unimodal_in_position_it_finds_the_exact_top_k():
    """q . k_j = -|j - 300| - 0.001 j: one peak, the best k slots are the k nearest it."""
    slots = torch.arange(1000).float()
    keys = torch.stack([torch.ones(1000), -(slots - 300).abs() - 0.001 * slots], -1)[None, None]
    query = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)
    read = _read(HiP(budget=4 + 40 + 8, n_sink=4, window=8, block_size=2), keys, query)[0][0]
    searched = read - set(range(4)) - set(range(992, 1000))
    exact = set((keys[0, 0, 4:992] @ query[0, 0, 0]).topk(40).indices.add(4).tolist())
    assert searched == exact


def test_a_range_that_fits_the_budget_is_read_whole_and_generates_the_plain_tokens():
    model, ids = tiny_model(), torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(6))
    plain = greedy(model, ids, 8)
    with kvpress.patch_model(model, "hip", budget=100, n_sink=4, window=16):
        assert greedy(model, ids, 8, cache=KVPressCache(model.config)).tolist() == plain.tolist()


def test_decoding_reads_at_most_the_budget_per_head():
    torch.manual_seed(3)
    read = _read(HiP(budget=40, n_sink=4, window=8, block_size=2), torch.randn(2, 2, 500, 8), torch.randn(2, 4, 1, 8))
    assert all(len(head) <= 40 and set(range(4)) <= head and set(range(492, 500)) <= head for row in read for head in row)


@pytest.mark.parametrize("params,match", [
    (dict(budget=20, n_sink=10, window=9), r"budget=20 leaves fewer than block_size=2 .* budget >= n_sink \+ window"),
    (dict(block_size=0), r"block_size=0; allowed values: an int >= 1"),
    (dict(window=-1), r"window=-1; allowed values: None or an int >= 0"),
])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(tiny_model(), "hip", **params)
