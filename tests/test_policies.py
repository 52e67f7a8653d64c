"""Each eviction policy keeps exactly the slots its algorithm's definition names.

The reference functions below are written from the definitions in docs/policies.md, one head at a time,
with no kvpress code: full attention matrices, explicit causal masks, plain top-k."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvpress import KVPressLayer
from kvpress.policies import H2O, TOVA, Context, Knorm, RandomPolicy, SnapKV, StreamingLLM

from conftest import counter_bytes

B, HQ, HKV, L, D = 2, 6, 2, 48, 8
G = HQ // HKV


def prefill(policy, q, k, valid=None, layer_idx=0):
    layer = KVPressLayer()
    layer.update(k, torch.randn_like(k), new_valid=valid)
    ctx = Context(layer_idx=layer_idx, layer=layer, phase="prefill", query=q,
                  scaling=q.shape[-1] ** -0.5)
    policy.observe(ctx)
    policy.on_prefill(ctx)
    return layer


def kept_sets(layer):
    pos, valid = layer.key_positions(), layer.key_valid()
    return [[set(pos[b, h][valid[b, h]].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


def causal_attention(qh, kh, first_row):
    """softmax(q k^T / sqrt(D)) for query rows starting at absolute position first_row, keys 0..L-1."""
    logits = qh @ kh.T / math.sqrt(qh.shape[-1])
    for i in range(qh.shape[0]):
        logits[i, first_row + i + 1:] = -math.inf
    return logits.softmax(-1)


# Each reference returns, per row and KV head, (score of every prompt position, positions always kept).
def ref_snapkv(q, k, window, kernel, pooling):
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    out = []
    for b in range(q.shape[0]):
        row = []
        for h in range(k.shape[1]):
            per_q_head = []
            for j in range(G):
                probs = causal_attention(q[b, h * G + j, L - window:], k[b, h], L - window)
                votes = probs.sum(0)[: L - window]  # softmax over all L keys, window columns then dropped
                per_q_head.append(pool(votes[None, None], kernel, 1, kernel // 2)[0, 0])
            score = torch.cat([torch.stack(per_q_head).mean(0), torch.zeros(window)])
            row.append((score, set(range(L - window, L))))
        out.append(row)
    return out


def ref_h2o(q, k, recent):
    out = []
    for b in range(q.shape[0]):
        row = []
        for h in range(k.shape[1]):
            acc = sum(causal_attention(q[b, h * G + j], k[b, h], 0).sum(0) for j in range(G))
            row.append((acc, set(range(L - recent, L))))
        out.append(row)
    return out


def ref_tova(q, k):
    out = []
    for b in range(q.shape[0]):
        last_row = torch.stack([causal_attention(q[b, i, -1:], k[b, i // G], L - 1)[0] for i in range(HQ)])
        out.append([(last_row.mean(0), set())] * k.shape[1])
    return out


def ref_knorm(k):
    return [[(-k[b, h].norm(dim=-1), set()) for h in range(k.shape[1])] for b in range(k.shape[0])]


def ref_streaming(n_sink):
    return [[(torch.arange(L).float(), set(range(n_sink)))] * HKV for _ in range(B)]


def assert_kept_is_top(layer, reference, budget, tol=1e-6, length=L):
    """Kept = forced positions + the best-scoring others: exactly `budget` per head, and no dropped position
    scores above a kept one (ties at the boundary may go either way)."""
    for b, row in enumerate(kept_sets(layer)):
        for h, kept in enumerate(row):
            score, forced = reference[b][h]
            assert len(kept) == budget and forced <= kept, (b, h)
            free_kept = [score[p] for p in kept - forced]
            dropped = [score[p] for p in set(range(length)) - kept]
            if free_kept and dropped:
                assert min(free_kept) >= max(dropped) - tol, (b, h)


@pytest.fixture
def qk():
    torch.manual_seed(0)
    return torch.randn(B, HQ, L, D), torch.randn(B, HKV, L, D)


@pytest.mark.parametrize("window,kernel,pooling", [(8, 7, "max"), (4, 5, "avg"), (8, 1, "max")])
def test_snapkv_matches_definition(qk, window, kernel, pooling):
    q, k = qk
    layer = prefill(SnapKV(budget=20, window_size=window, kernel_size=kernel, pooling=pooling), q, k)
    assert_kept_is_top(layer, ref_snapkv(q, k, window, kernel, pooling), 20)


@pytest.mark.parametrize("budget,recent", [(16, 8), (20, 4), (12, 0)])
def test_h2o_matches_definition(qk, budget, recent):
    q, k = qk
    assert_kept_is_top(prefill(H2O(budget=budget, recent=recent), q, k), ref_h2o(q, k, recent), budget)


def test_h2o_prefill_scores_are_chunked(qk, monkeypatch):
    """An 8K prompt must never materialise [L, L]: force tiny chunks and check the result is unchanged."""
    import kvpress.kernels.scores as scores

    q, k = qk
    monkeypatch.setattr(scores, "_BLOCK_ELEMENTS", B * HQ * L * 3)  # 3 query rows per block
    assert_kept_is_top(prefill(H2O(budget=16, recent=4), q, k), ref_h2o(q, k, 4), 16)


def test_tova_matches_definition(qk):
    q, k = qk
    layer = prefill(TOVA(budget=16), q, k)
    assert_kept_is_top(layer, ref_tova(q, k), 16)
    assert all(len(set(map(frozenset, row))) == 1 for row in kept_sets(layer))  # one set for all KV heads


def test_knorm_matches_definition(qk):
    q, k = qk
    # norms are compared at 16 significant bits: a kept key may lose to a dropped one by that rounding
    tol = float(k.norm(dim=-1).max()) * 2**-16
    assert_kept_is_top(prefill(Knorm(budget=16), q, k), ref_knorm(k), 16, tol=tol)


def test_knorm_keeps_the_same_keys_whatever_the_rounding_of_the_rotation():
    """A token repeated at many positions: its rotated keys have one norm, up to the last bits of the rotation,
    which differ from CPU to CPU. Knorm's kept set must not depend on those bits: the earliest copies are kept."""
    torch.manual_seed(1)
    base = torch.randn(B, HKV, 1, 64)
    others = torch.randn(B, HKV, L - 8, 64) * 1.5  # larger norms: evicted first
    angles = torch.rand(8, 32) * 2 * math.pi  # the repeated token at 8 positions, each rotated pairwise
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = base[..., :32], base[..., 32:]
    copies = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)  # [B, HKV, 8, 64]: equal norms
    k = torch.cat([others[:, :, :20], copies, others[:, :, 20:]], 2)
    q = torch.randn(B, HQ, L, 64)
    want = [[set(range(20, 24))] * HKV] * B  # budget 4 of 8 tied copies: the first four
    assert kept_sets(prefill(Knorm(budget=4), q, k)) == want
    for trial in range(5):  # last-bit noise, as another CPU's rotation would leave
        noisy = k * (1 + 2e-7 * torch.randn(k.shape))
        assert kept_sets(prefill(Knorm(budget=4), q, noisy)) == want, trial


def test_streaming_llm_matches_definition(qk):
    q, k = qk
    assert_kept_is_top(prefill(StreamingLLM(n_sink=4, window=12), q, k), ref_streaming(4), 16)


def test_random_is_seeded_and_sized(qk):
    q, k = qk
    a, b = kept_sets(prefill(RandomPolicy(budget=10, seed=3), q, k)), kept_sets(prefill(RandomPolicy(budget=10, seed=3), q, k))
    assert a == b and all(len(s) == 10 for row in a for s in row)
    assert a != kept_sets(prefill(RandomPolicy(budget=10, seed=4), q, k))


ALL = {
    "snapkv": lambda **kw: SnapKV(window_size=4, **kw),
    "h2o": lambda **kw: H2O(**kw),
    "tova": lambda **kw: TOVA(**kw),
    "knorm": lambda **kw: Knorm(**kw),
    "streaming_llm": lambda **kw: StreamingLLM(**kw),
    "random": lambda **kw: RandomPolicy(**kw),
}


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_budget_from_ratio_and_bytes_freed(qk, name, ratio):
    q, k = qk
    before = KVPressLayer()
    before.update(k, torch.randn_like(k))
    full_kv = before.kv_nbytes()
    layer = prefill(ALL[name](compression_ratio=ratio), q, k)
    n_keep = L - math.ceil(L * ratio)  # never a token over the ratio: 48 x 0.9 = 43.2 removes 44
    assert layer.view_width == n_keep and (layer.tokens_per_head() == n_keep).all()
    assert layer.kv_nbytes() * L == full_kv * n_keep  # K/V bytes fall exactly by the ratio
    # nbytes() is the size of the allocations themselves (no view of a bigger buffer hides bytes)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for segment in layer.segments for t in segment.tensors()}
    assert layer.nbytes() == sum(storages.values()) + counter_bytes(layer)


@pytest.mark.parametrize("name", sorted(set(ALL) - {"random"}))
def test_padded_row_compresses_its_own_tokens(name):
    """Row 1 is row 0's last L-P tokens behind P pads: it must keep the same tokens, shifted by P."""
    torch.manual_seed(1)
    P = 10
    q, k = torch.randn(1, HQ, L, D), torch.randn(1, HKV, L, D)
    q2, k2 = q.clone(), k.clone()
    q2[:, :, :P], k2[:, :, :P] = torch.randn(1, HQ, P, D), torch.randn(1, HKV, P, D)  # pad garbage
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, :P] = False
    policy = ALL[name](compression_ratio=0.5)
    alone_layer = KVPressLayer()
    alone_layer.update(k[:, :, P:], torch.randn_like(k[:, :, P:]))
    ctx = Context(layer_idx=0, layer=alone_layer, phase="prefill", query=q[:, :, P:],
                  scaling=D ** -0.5)
    n_keep = torch.full((1, HKV), (L - P) - (L - P) // 2)
    policy.observe(ctx)
    alone_scores, forced = policy.score(ctx)[0], policy.protected(ctx, n_keep)
    batched = prefill(policy, torch.cat([q, q2]), torch.cat([k, k2]), valid)
    row = kept_sets(batched)[1]
    assert all(min(s) >= P for s in row)  # padding never counts as kept content
    shifted = SimpleNamespace(key_positions=lambda: batched.key_positions()[1:] - P, key_valid=lambda: batched.key_valid()[1:])
    forced_sets = [set() if forced is None else set(forced[0, h].nonzero().flatten().tolist()) for h in range(HKV)]
    assert_kept_is_top(shifted, [[(alone_scores[h], forced_sets[h]) for h in range(HKV)]], int(n_keep[0, 0]), length=L - P)


@pytest.mark.parametrize("name", ["snapkv", "knorm", "h2o", "tova", "streaming_llm"])
def test_a_context_built_from_plain_tensors_scores_like_the_integrations(name):
    """Context.from_tensors: queries, keys, values (and a padding mask) with no transformers module behind them, as
    a serving engine holds them. The scorer sees the same layer and cuts the same slots."""
    torch.manual_seed(3)
    q, k, v = torch.randn(B, HQ, L, D), torch.randn(B, HKV, L, D), torch.randn(B, HKV, L, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :5] = False
    policy = ALL[name](compression_ratio=0.5)
    ctx = Context.from_tensors(q, k, v, valid=valid)
    assert ctx.module is None and ctx.phase == "prefill" and ctx.scaling == D ** -0.5
    policy.observe(ctx)
    scores = policy.score(ctx)
    policy.on_prefill(ctx)
    reference = KVPressLayer()
    reference.update(k, v, new_valid=valid)
    by_hand = Context(layer_idx=0, layer=reference, phase="prefill", query=q, scaling=D ** -0.5)
    policy.observe(by_hand)
    assert torch.equal(scores, policy.score(by_hand))
    policy.on_prefill(by_hand)
    assert kept_sets(ctx.layer) == kept_sets(reference)
    assert torch.equal(ctx.layer.values_view(), reference.values_view())
