"""CommVQ (docs/policies.md 12.10), checked against its definition written here on its own: codewords that are 2x2
blocks [[x, -y], [y, x]] commuting with every RoPE rotation, the nearest of all 4096 codewords by brute force, greedy
residual coding of the unit vector, the tables' least-squares solve; a decode step of a patched model reads exactly
the keys and values the definition decodes; the bytes held are the codes, norms and positions."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import codebooks
from kvpress.formats import commvq as cv
from kvpress.kernels import vq_search
from kvpress.formats.calibration import Calibration

from conftest import tiny_model
from test_shadowkv import THETA, _rope

D, P = 16, 8  # the tiny Llama's head_dim, and its pairs per group


def _codeword(table, code):
    """[P] complex: t[p, a] + J t[p, b] per pair, J the 90-degree rotation (x, y) -> (-y, x), in real arithmetic."""
    a, b = divmod(int(code), 64)
    ta, tb = torch.view_as_real(table[:, a]).double(), torch.view_as_real(table[:, b]).double()
    x, y = ta[:, 0] - tb[:, 1], ta[:, 1] + tb[:, 0]
    return torch.complex(x, y)


def _all_codewords(table):
    return torch.stack([_codeword(table, c) for c in range(4096)])  # [4096, P]


def _pairs(x):
    """Unit vector x / |x| as complex RoPE pairs (channel i, channel i + D/2)."""
    x = x.double() / x.double().norm()
    return torch.complex(x[:D // 2], x[D // 2:])


def _tables(seed=0, groups=1, stages=3):
    g = torch.Generator().manual_seed(seed)
    shape = (groups, stages, P, 64)
    return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) * 0.3


def test_each_codeword_commutes_with_every_rope_rotation():
    """As a real 2x2 block per pair, every codeword is [[x, -y], [y, x]], which commutes with R(theta); so RoPE of a
    decoded vector equals decoding with every table entry rotated by the pair's angle at that position."""
    tables = _tables(stages=2)
    table = tables[0, 0]
    for code in (0, 77, 4095, 1234):
        c = torch.view_as_real(_codeword(table, code))
        for theta in (0.3, -1.7, 2.9):
            rot = torch.tensor([[torch.cos(torch.tensor(theta)), -torch.sin(torch.tensor(theta))],
                                [torch.sin(torch.tensor(theta)), torch.cos(torch.tensor(theta))]], dtype=torch.float64)
            for x, y in c:
                block = torch.tensor([[x, -y], [y, x]], dtype=torch.float64)
                assert torch.allclose(rot @ block, block @ rot)
    codes = torch.randint(0, 4096, (5, 1, 2))
    norms = torch.rand(5) + 0.5
    decoded = cv.decode(codes, norms, cv.bag_weights(tables))
    position = 37
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    turned = tables * torch.exp(1j * position * inv).to(tables.dtype)[None, None, :, None]
    rotated_first = cv.decode(codes, norms, cv.bag_weights(turned))
    assert torch.allclose(_rope(decoded.double(), torch.full((5,), position)), rotated_first.double(), atol=1e-5)


def test_nearest_is_the_argmin_over_all_4096_codewords_in_c_and_in_torch():
    table = _tables()[0, 0]
    residuals = torch.complex(torch.randn(1300, P), torch.randn(1300, P))
    brute = (residuals.to(torch.complex128)[:, None] - _all_codewords(table)[None]).abs().square().sum(-1).argmin(1)
    assert torch.equal(vq_search.nearest_reference(residuals, table), brute)
    if vq_search.available():  # (the C search where a compiler works; CI machines have one)
        assert torch.equal(vq_search.nearest(residuals, table), brute)


def test_encode_is_greedy_residual_coding_of_the_unit_vector_and_decode_its_sum():
    tables = _tables(stages=3)
    x = torch.randn(20, D) * 3
    codes, norms = vq_search.encode(x, tables)
    words = [_all_codewords(tables[0, s]) for s in range(3)]
    for n in range(20):
        residual, total = _pairs(x[n]), 0
        for s in range(3):
            best = int((residual[None] - words[s]).abs().square().sum(-1).argmin())
            assert int(codes[n, 0, s]) == best
            residual, total = residual - words[s][best], total + words[s][best]
        expected = torch.cat([total.real, total.imag]) * x[n].double().norm()
        assert torch.allclose(cv.decode(codes[n:n + 1], norms[n:n + 1], cv.bag_weights(tables))[0].double(),
                              expected, atol=1e-4)
    assert torch.allclose(norms, x.norm(dim=-1))


@pytest.mark.parametrize("groups, stages", [(1, 8), (2, 3)])
def test_the_c_encoder_codes_as_the_stage_by_stage_search_does(groups, stages, monkeypatch):
    """vq_cpu.c's one-call encoder against encode_reference (the torch search, checked above against brute force):
    the same codes (A and B are summed in another order, so a near tie may go the other way: at most 1% of rows)
    and never a farther reconstruction; without a compiler, encode is the reference."""
    tables = _tables(seed=3, groups=groups, stages=stages)
    x = torch.randn(1500, 2 * P * groups) * 2
    reference, norms = vq_search.encode_reference(x, tables)
    monkeypatch.setattr(vq_search, "available", lambda: False)
    assert torch.equal(vq_search.encode(x, tables)[0], reference)
    monkeypatch.undo()
    if not vq_search.available():
        pytest.skip("no C compiler: encode is encode_reference")
    codes, c_norms = vq_search.encode(x, tables)
    assert codes.shape == reference.shape and torch.equal(c_norms, norms)
    assert (codes == reference).all(-1).all(-1).float().mean() >= 0.99
    weights = cv.bag_weights(tables)
    error = (cv.decode(codes, norms, weights) - x).norm(dim=-1)
    assert (error <= (cv.decode(reference, norms, weights) - x).norm(dim=-1) + 1e-4).all()


def test_the_table_solve_is_least_squares_over_the_codes():
    """With codes fixed, the table of one pair minimises sum |r - t_a - J t_b|^2: a real least-squares problem over its
    64 entries (x, y), built here as a design matrix."""
    g = torch.Generator().manual_seed(1)
    n = 2000
    codes = torch.randint(0, 4096, (n,), generator=g)
    residual = torch.complex(torch.randn(n, 1, generator=g), torch.randn(n, 1, generator=g))
    solved = codebooks._solve_table(residual, codes, ridge=0.0)[0]
    design = torch.zeros(2 * n, 128, dtype=torch.float64)  # rows: real, imaginary part of sample; cols: x_e, y_e
    for i, code in enumerate(codes.tolist()):
        a, b = divmod(code, 64)
        design[2 * i, 2 * a] += 1
        design[2 * i + 1, 2 * a + 1] += 1  # t_a = (x_a, y_a)
        design[2 * i, 2 * b + 1] -= 1
        design[2 * i + 1, 2 * b] += 1  # J t_b = (-y_b, x_b)
    target = torch.view_as_real(residual[:, 0]).double().flatten()
    expected = torch.linalg.lstsq(design, target[:, None]).solution.view(64, 2)
    assert torch.allclose(torch.view_as_real(solved).double(), expected, atol=1e-4)


def test_fitted_tables_lose_less_with_each_stage_also_on_held_out_vectors():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 4, generator=g) @ torch.randn(4, D, generator=g) + 0.1 * torch.randn(3000, D, generator=g)
    tables, errors = codebooks.fit_tables(x[:2000], P, stages=4, iters=4)
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]))
    held_out = []
    for stages in range(1, 5):
        codes, norms = vq_search.encode(x[2000:], tables[:, :stages])
        decoded = cv.decode(codes, norms, cv.bag_weights(tables[:, :stages]))
        held_out.append(float(((decoded - x[2000:]).norm(dim=-1) / x[2000:].norm(dim=-1)).mean()))
    assert all(later < earlier for earlier, later in zip(held_out, held_out[1:]))
    assert held_out[-1] < 0.25


def test_twelve_bit_codes_pack_two_in_three_bytes():
    codes = torch.randint(0, 4096, (3, 5, 9))
    packed = cv.pack12(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 15)  # 9 codes padded to 10: 15 bytes
    assert torch.equal(cv.unpack12(packed, 9), codes)


# ---------------------------------------------------------------------------- in a patched model
T, CODED = 40, 32  # prompt tokens; residual_length 8, block 8: the oldest 32 are coded at prefill


def _coded(x, stage_words, position):
    """The definition's stored key (or value, position None) of one vector: greedy codes of the unit vector over
    each stage's codewords ([4096, P] per stage, one group), the decoded sum times the fp16 norm, RoPE at its
    position."""
    if position is not None:
        x = _rope(x.double()[None], torch.tensor([-position]))[0]  # un-rotate: RoPE at -p
    residual, total = _pairs(x), 0
    for words in stage_words:
        best = int((residual[None] - words).abs().square().sum(-1).argmin())
        residual, total = residual - words[best], total + words[best]
    out = torch.cat([total.real, total.imag]) * x.double().norm().half().double()
    return out if position is None else _rope(out[None], torch.tensor([position]))[0]


def test_a_decode_step_reads_the_keys_and_values_the_definition_decodes(llama_file):
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, T), generator=torch.Generator().manual_seed(3))
    nxt = torch.tensor([[5]])
    books = Calibration.load(llama_file).codebooks
    stages = 2
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(ids, cache=reference, use_cache=True)
        for layer_idx, layer in enumerate(reference.layers):
            for kind, tensor in (("keys", layer.keys), ("values", layer.values)):
                for h in range(tensor.shape[1]):
                    tables = books[kind][layer_idx, h][:, :stages + (kind == "values")]
                    words = [_all_codewords(tables[0, s]) for s in range(tables.shape[1])]
                    for t in range(CODED):
                        tensor[0, h, t] = _coded(tensor[0, h, t], words, t if kind == "keys" else None).float()
        expected = model(nxt, cache=reference, use_cache=True).logits
        with kvpress.patch_model(model, policy="commvq", calibration=str(llama_file), key_stages=stages,
                                 value_stages=stages + 1, residual_length=8, block_size=8):
            cache = kvpress.KVPressCache(model.config)
            model(ids, cache=cache, use_cache=True)
            layer = cache.layers[0]
            assert layer.quantized_len == CODED
            got = model(nxt, cache=cache, use_cache=True).logits
    assert torch.allclose(got, expected, atol=1e-4)


def test_bytes_held_are_the_codes_and_norms(llama_file):
    """Per coded slot and KV head: 3 bytes per two codes (Sk key and Sv value stages of one group), two fp16 norms;
    consecutive RoPE positions are held as one start per row. After an eviction every slot holds its int32 RoPE
    position."""
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 72), generator=torch.Generator().manual_seed(4))
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    for key_stages, value_stages, policy, extra in ((1, 2, "commvq", {}), (3, 3, "commvq", {}),
                                                   (2, 2, "snapkv+commvq", dict(compression_ratio=0.5))):
        with torch.no_grad(), kvpress.patch_model(model, policy=policy, calibration=str(llama_file), **extra,
                                                  key_stages=key_stages, value_stages=value_stages,
                                                  residual_length=8, block_size=8):
            cache = kvpress.KVPressCache(model.config)
            model(ids, cache=cache, use_cache=True)
        codes = [s.data for _, layer in cache.kvpress_layers() for s in layer.segments if s.low_bit]
        slots = sum(c.num_slots * c.batch_heads[1] for c in codes)
        per_slot = 3 * ((key_stages + value_stages + 1) // 2) + 2 * 2
        if extra:  # (snapkv keeps 36 of 72 per head: 24 coded, whole blocks of 8 behind 8 + 4 in full precision)
            assert slots == layers * heads * 24 and sum(c.nbytes() for c in codes) == slots * (per_slot + 4)
        else:
            assert slots == layers * heads * 64 and sum(c.nbytes() for c in codes) == slots * per_slot + layers * 4


def test_bad_settings_are_refused_before_the_model_changes(llama_file, tmp_path):
    model = tiny_model("llama")
    for params, match in ((dict(key_stages=0), "key_stages=0"), (dict(value_stages=0), "value_stages=0"),
                          (dict(value_stages=99), "value_stages=99 but the calibration"),
                          (dict(block_size=0), "block_size=0"), (dict(residual_length=-1), "residual_length=-1")):
        with pytest.raises(ValueError, match=match):
            kvpress.patch_model(model, policy="commvq", calibration=str(llama_file), **params)
    bare = Calibration.load(llama_file)
    bare.codebooks = None
    bare.save(tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="holds no codebooks.*--codebooks-only"):
        kvpress.patch_model(model, policy="commvq", calibration=str(tmp_path / "bare.safetensors"))
    assert kvpress.integrations.registry.patch_of(model) is None


def test_the_default_read_is_the_measured_best_rate_at_most_the_shipped_stages(llama_file):
    """Defaults: 1.5 bits of codes per number (8 stages of a 64-channel group: the config docs/results/commvq measured
    best on SmolLM2, 85% of the full score at 11.4% of its bytes), a 16-token window and 16-token blocks. The tiny
    Llama's 16-channel heads: 1.5 * 16 / 12 = 2 of its 3 stages; a rate above what is shipped reads every stage."""
    from kvpress.policies.commvq import CODE_BITS, READ_BITS

    assert (READ_BITS * 64 / CODE_BITS, READ_BITS * 128 / CODE_BITS) == (8, 16)
    model = tiny_model("llama")
    with kvpress.patch_model(model, policy="commvq", calibration=str(llama_file)) as patch:
        used = patch.policy
    assert (used.key_stages, used.value_stages, used.residual_length, used.block_size) == (2, 2, 16, 16)
    books = Calibration.load(llama_file).codebooks["keys"]
    assert books.shape[3] == 3 and books.shape[4] == P


@pytest.mark.real_model
def test_smollm2s_default_read_is_the_measured_config(smollm2):
    model, _ = smollm2
    with kvpress.patch_model(model, policy="commvq") as patch:
        used = patch.policy
    assert (used.key_stages, used.value_stages, used.residual_length, used.block_size) == (8, 8, 16, 16)
