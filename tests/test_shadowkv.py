"""ShadowKV (docs/policies.md 9.5): each read is the paper's definition, written here on its own (RoPE from its
formula, the SVD of the un-rotated keys, chunk means, outlier chunks by cosine, landmark softmax, top chunks); at full
rank with every chunk read it generates the full cache's tokens; its values live in a file and its bytes count the
memory tier only; bad settings are refused before anything changes; as a draft it is lossless."""

import pytest
import torch
from transformers import LlamaConfig

import kvpress
from kvpress import KVPressCache, KVPressLayer
from kvpress.cache.saving import to_tensors
from kvpress.cache.shadow import FileTier
from kvpress.kernels.online_softmax import Queries
from kvpress.policies import Context, ShadowKV, ShadowKVView
from kvpress.positions import Rotary
from kvpress.speculative import speculative_generate

from conftest import _COMMON, greedy, tiny_model

B, HQ, HKV, T, D = 2, 4, 2, 75, 16
THETA = LlamaConfig(**_COMMON).rope_parameters["rope_theta"]


def _rope(x, positions):
    """Half-split RoPE of x [..., n, D] at positions [n], from the formula."""
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = positions.double()[:, None] * inv
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


def _prompt(seed=0):
    """Pre-RoPE keys of rank 3 plus noise (the structure ShadowKV exploits), their post-RoPE form, values."""
    g = torch.Generator().manual_seed(seed)
    pre = (torch.randn(B, T, 3, generator=g) @ torch.randn(B, 3, HKV * D, generator=g)).view(B, T, HKV, D)
    pre = pre.transpose(1, 2).double() + 0.05 * torch.randn(B, HKV, T, D, generator=g).double()
    return pre, _rope(pre, torch.arange(T)), torch.randn(B, HKV, T, D, generator=g).double()


def _chosen(post, query, policy):
    """{(row, KV head): (slots read through landmarks, slots read exactly)} by the definition (no padding)."""
    c, g, out = policy.chunk_size, HQ // HKV, {}
    n = T // c - policy.local_chunks
    for b in range(B):
        for h in range(HKV):
            chunks = post[b, h, :n * c].view(n, c, D)
            means = chunks.mean(1)
            cosine = torch.stack([torch.nn.functional.cosine_similarity(chunks[i], means[i][None], dim=-1).min()
                                  for i in range(n)])
            outliers = set(cosine.argsort()[:policy.outlier_chunks].tolist())
            others = [i for i in range(n) if i not in outliers]
            q = query[b, h * g:(h + 1) * g, 0].double()
            score = torch.softmax(q @ means[others].T * D ** -0.5, -1).amax(0)
            chosen = [others[i] for i in score.topk(policy.budget // c).indices.tolist()]
            out[b, h] = ([i * c + j for i in chosen for j in range(c)],
                         [i * c + j for i in sorted(outliers) for j in range(c)] + list(range(n * c, T)))
    return out


def _expected(pre, post, values, query, policy, rank):
    """Attention output [B, HQ, 1, D] of one decode query by the definition, per row and KV head."""
    g = HQ // HKV
    out = torch.zeros(B, HQ, 1, D, dtype=torch.float64)
    chosen = _chosen(post, query, policy)
    for b in range(B):
        u, s, vh = torch.linalg.svd(pre[b].transpose(0, 1).reshape(T, HKV * D), full_matrices=False)
        low = ((u[:, :rank] * s[:rank]) @ vh[:rank]).view(T, HKV, D).transpose(0, 1)
        low = _rope(low, torch.arange(T))
        for h in range(HKV):
            read, exact = chosen[b, h]
            keys = torch.cat([low[h, read], post[b, h, exact]])
            vals = torch.cat([values[b, h, read], values[b, h, exact]])
            q = query[b, h * g:(h + 1) * g, 0].double()
            weights = torch.softmax(q @ keys.T * D ** -0.5, -1)
            out[b, h * g:(h + 1) * g, 0] = weights @ vals
    return out


def test_the_draft_view_reads_the_same_chunks_with_their_exact_keys():
    _, post, _ = _prompt(2)
    view = ShadowKVView(budget=16, chunk_size=4, local_chunks=2, outlier_chunks=3)
    query = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(6))
    layer = KVPressLayer()
    layer.update(post.float(), torch.randn(B, HKV, T, D))
    slots, ok = view.select(Context(layer_idx=0, layer=layer, phase="decode", query=query, scaling=D ** -0.5))
    got = {(b, h): sorted(slots[b, h][ok[b, h]].tolist()) for b in range(B) for h in range(HKV)}
    assert got == {key: sorted(read + exact) for key, (read, exact) in _chosen(post, query, view).items()}


def test_a_read_is_the_definition_of_shadowkv():
    pre, post, values = _prompt()
    policy = ShadowKV(budget=16, chunk_size=4, rank=5, local_chunks=2, outlier_chunks=3)
    query = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(5))
    rotary = Rotary.from_config(LlamaConfig(**_COMMON))
    ctx = Context.from_tensors(torch.randn(B, HQ, T, D), post.float(), values.float(), rotary=rotary,
                               rope_positions=torch.arange(T)[None])
    policy.on_prefill(ctx)
    layer = ctx.layer
    assert [s.kind for s in layer.segments] == ["shadow", "dense"]
    got = layer.attention(Queries(query, torch.tensor([T]), D ** -0.5))
    torch.testing.assert_close(got.double(), _expected(pre, post, values, query, policy, 5), atol=2e-4, rtol=1e-3)


def test_primary_tier_bytes_and_the_value_file():
    pre, post, values = _prompt(1)
    policy = ShadowKV(budget=16, chunk_size=4, rank=5, local_chunks=2, outlier_chunks=3)
    ctx = Context.from_tensors(torch.randn(B, HQ, T, D), post.float(), values.float(),
                               rotary=Rotary.from_config(LlamaConfig(**_COMMON)))
    full = ctx.layer.nbytes()
    policy.on_prefill(ctx)
    shadow = ctx.layer.segments[0].data
    assert shadow.values.untyped_storage().filename is not None  # memory-mapped from a file
    assert torch.equal(shadow.values, values.float())
    assert shadow.offloaded_nbytes() == B * HKV * T * D * 4
    n = T // 4 - 2  # outlier or landmark chunks per row
    exact = 3 * 4 + T - n * 4
    expected = (B * T * 5 + B * HKV * 5 * D) * 4 + B * T * 4 + B * HKV * (n - 3) * (D * 4 + 8 + 1) \
        + B * HKV * exact * (8 + 1 + 2 * D * 4)
    assert shadow.nbytes() == ctx.layer.nbytes() == expected  # (the tail is empty)
    assert expected < full * 0.6  # a third of this short prompt's slots are exact: at 16K they are a few percent


def test_full_rank_reading_every_chunk_generates_the_full_caches_tokens():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with kvpress.patch_model(model, "shadowkv", budget=64, chunk_size=8, rank=32, outlier_chunks=0):
            cache = KVPressCache(model.config)
            out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache, output_logits=True,
                                 return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
    assert cache.offloaded_nbytes() == 2 * 2 * 70 * 16 * 4  # the values: layers x KV heads x prompt x D x fp32
    assert all(layer.segments[0].kind == "shadow" for _, layer in cache.kvpress_layers())


def test_a_small_budget_reads_less_and_changes_the_output():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with kvpress.patch_model(model, "shadowkv", budget=8, chunk_size=4, rank=4, local_chunks=1, outlier_chunks=1):
            cache = KVPressCache(model.config)
            out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache, output_logits=True,
                                 return_dict_in_generate=True)
    shadow = cache.layers[0].segments[0].data
    assert shadow.read_slots() == 8 + 4 + 4 + 2  # 2 chunks, 1 outlier chunk, 1 local chunk, 2 unaligned
    assert not torch.allclose(torch.stack(out.logits[1:]), torch.stack(ref.logits[1:]), atol=1e-4)  # decode steps


@pytest.mark.parametrize("params, match", [
    (dict(budget=0), r"shadowkv: budget=0; allowed values: an int >= 1"),
    (dict(chunk_size=0), r"shadowkv: chunk_size=0; allowed values: an int >= 1"),
    (dict(outlier_chunks=-1), r"shadowkv: outlier_chunks=-1; allowed values: an int >= 0"),
    (dict(rank=0), r"shadowkv: rank=0; allowed values: None or an int >= 1"),
    (dict(rank=33), r"shadowkv: rank=33 exceeds the keys' width \(KV heads x head_dim = 32\); allowed values: None "
                    r"or 1..32"),
    (dict(offload_dir="/no/such/folder"), r"shadowkv: offload_dir='/no/such/folder' is not a folder"),
    (dict(prefill_chunk_size=16), r"prefill_chunk_size=16: shadowkv factorises each layer's whole prompt at once"),
])
def test_bad_settings_are_refused_before_the_model_changes(params, match):
    model = tiny_model("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=match):
        kvpress.patch_model(model, "shadowkv", **params)
    assert {n: type(m) for n, m in model.named_modules()} == before



@pytest.mark.parametrize("composed, params", [("snapkv+shadowkv", dict(compression_ratio=0.5)), ("shadowkv+kivi", {})])
def test_it_composes_with_nothing(composed, params):
    with pytest.raises(ValueError, match=r"policy: 'shadowkv' is a storage tier .* composes with no eviction policy or "
                                         r"codec; allowed: 'shadowkv' alone"):
        kvpress.patch_model(tiny_model("llama"), composed, **params)


def test_a_shadow_cache_is_not_saved_silently():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40))
    with kvpress.patch_model(model, "shadowkv", budget=8, chunk_size=4, local_chunks=1, outlier_chunks=1), \
            torch.no_grad():
        cache = KVPressCache(model.config)
        model(ids, cache=cache)
    with pytest.raises(ValueError, match=r"\['ShadowKeys'\] storage, which is not saved"):
        to_tensors(cache)


def test_as_a_draft_greedy_output_is_plain_greedy():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(4))
    ref = greedy(model, ids, 20)
    out = speculative_generate(model, ids, draft="shadowkv", gamma=3, max_new_tokens=20, draft_budget=8,
                               chunk_size=4, local_chunks=2, outlier_chunks=2)
    assert out.tolist() == ref.tolist()


@pytest.mark.skipif(FileTier("/dev/shm").memory_filesystem() is None, reason="no tmpfs at /dev/shm here")
def test_a_folder_in_memory_is_refused_as_the_file_tier():
    with pytest.raises(ValueError, match=r"shadowkv: offload_dir='/dev/shm' puts the values in '/dev/shm', a tmpfs "
                                         r"folder that keeps its files in RAM; allowed values: a folder on disk"):
        ShadowKV(offload_dir="/dev/shm")
