"""Calibrated selection: the calibration file, KVzap (predicted KVzip scores), the head split (streaming vs
retrieval heads), and chunked prefill that hears a known question. References are written from the definitions
with the stock model and plain tensor code."""

import json
import math
import zlib

import pytest
import torch

import kvpress
from kvpress import KVPressCache
from kvpress.calibration import Calibration, calibrate, collect, calibration_texts, fit, model_identity
from kvpress.formats import less as less_format

from conftest import TOK, greedy, record_held_tokens, tiny_model


class WordTokenizer:
    """Words hashed onto the tiny models' 125 ids: every id occurs in a few hundred words of text."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3 + zlib.crc32(word.encode()) % 125 for word in text.split()]


def _attention_inputs(model, ids):
    """{layer: [B, T, H]} the input of every attention module, from the stock model (forward pre-hooks)."""
    captured, handles = {}, []
    for layer in model.model.layers:
        attn = layer.self_attn

        def hook(module, args, kwargs, i=attn.layer_idx):
            captured[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return captured


# ---------------------------------------------------------------------------- calibration
def test_calibration_recovers_a_planted_linear_relation():
    """Real hidden states of a tiny model, scores planted as exp(h W + b): the fit predicts the planted log-scores of
    held-out text, and ranks its tokens as the planted relation does."""
    model = tiny_model("llama")
    tok = WordTokenizer()
    records = collect(model, tok, calibration_texts(tok, 4, 300, seed=1), log=lambda *a: None)
    g = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    planted = {i: (torch.randn(hidden, 2, generator=g) * 0.05, torch.tensor([-2.0, -3.0])) for i in records[0]["scores"]}
    for r in records:
        r["scores"] = {i: (r["hidden"][i].float() @ w + b).exp().T for i, (w, b) in planted.items()}
    calibration = fit(records, model_identity(model), held_out=1, tokens_per_text=300, ridge=1e-9)
    held_out = records[-1]
    for layer, (w, b) in planted.items():
        hidden = held_out["hidden"][layer].float()
        predicted = calibration.predict(layer, hidden[None])[0][:, 4:]  # sinks are never scored
        torch.testing.assert_close(predicted, (hidden @ w + b).T[:, 4:], atol=1e-3, rtol=0)
    assert calibration.metrics["spearman"] > 0.999
    assert calibration.metrics["top25_overlap"] > 0.97


def test_calibration_file_round_trips_and_cannot_run_code(llama_file):
    loaded = Calibration.load(llama_file)
    model = tiny_model("llama")
    assert loaded.identity == model_identity(model)
    assert loaded.kind == "linear" and loaded.layers == [0, 1]
    assert set(loaded.metrics) >= {"spearman", "top25_overlap", "global_top25_overlap"}
    # safetensors: an 8-byte header length, a JSON header, raw tensor bytes; nothing a loader executes
    raw = llama_file.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert set(header) - {"__metadata__"} == {"weight", "bias", "head_error", "label_channels", "codebook_keys",
                                             "codebook_values", *(f"less_{name}" for name in less_format.NAMES)}
    assert header["less_q1"]["dtype"] == "F16" and header["less_q1"]["shape"] == [2, 4, 16, 16]  # [L, Hq, D, hidden]
    assert header["codebook_keys"]["dtype"] == "F16"  # CommVQ's tables: [L, Hkv, G, S, P, 64, 2] (real, imaginary)
    assert header["codebook_keys"]["shape"] == [2, 2, 1, 3, 8, 64, 2]
    assert llama_file.stat().st_size < 1_000_000
    again = llama_file.with_name("again.safetensors")
    loaded.save(again)
    for name, tensor in loaded.tensors.items():
        assert torch.equal(Calibration.load(again).tensors[name], tensor)
    assert torch.equal(Calibration.load(again).channels, loaded.channels)
    for kind in ("keys", "values"):
        assert torch.equal(Calibration.load(again).codebooks[kind], loaded.codebooks[kind])


def test_a_missing_or_mismatched_calibration_is_refused_with_the_command(llama_file, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kvpress calibrate --model"):
        kvpress.patch_model(model, "kvzap", compression_ratio=0.5)  # no file beside a model without a folder
    with pytest.raises(ValueError, match="kvpress calibrate --model"):
        kvpress.patch_model(model, "duo_attention", calibration=str(tmp_path / "absent.safetensors"))
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="made for another model.*kvpress calibrate --model"):
        kvpress.patch_model(other, "kvzap", compression_ratio=0.5, calibration=str(llama_file))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ValueError, match="not a kvpress calibration file"):
        kvpress.patch_model(model, "kvzap", compression_ratio=0.5, calibration=str(tmp_path / "foreign.safetensors"))
    assert model.config._attn_implementation == "sdpa"  # refused before the model was touched
    with pytest.raises(ValueError, match="kind='tree'"):
        calibrate(model, TOK, kind="tree")


# ---------------------------------------------------------------------------- kvzap
@pytest.mark.parametrize("window", [0, 10, 60, None])
def test_kvzap_keeps_each_heads_top_predicted_slots(llama_file, window):
    """uniform allocation: each KV head keeps its sinks, then its newest `window` tokens, then the slots with the
    highest h W + b, from the stock model's attention inputs and the file's weights. A window wider than the budget
    (60 of 90 tokens, budget 36) is cut by the predicted scores; the default window (128) covers this whole prompt,
    which leaves the predicted order alone."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    calibration = Calibration.load(llama_file)
    inputs = _attention_inputs(model, ids)
    cache = KVPressCache(model.config)
    options = {} if window is None else dict(window=window)
    with kvpress.patch_model(model, "kvzap", compression_ratio=0.6, budget_allocation="uniform",
                             calibration=str(llama_file), **options), torch.no_grad():
        model(ids, cache=cache)
    budget, window = 90 - math.floor(90 * 0.6), 128 if window is None else window
    for rank, layer_idx in enumerate(calibration.layers):
        predicted = inputs[layer_idx][0].float() @ calibration.tensors["weight"][rank] + calibration.tensors["bias"][rank]
        layer = cache.layers[layer_idx]
        for head in range(predicted.shape[1]):
            group = lambda t: 2 if t < 4 else 1 if t >= 90 - window else 0  # noqa: E731  sinks, window, the rest
            order = sorted(range(90), key=lambda t: (group(t), float(predicted[t, head])), reverse=True)
            kept = sorted(layer.key_positions()[0, head][layer.key_valid()[0, head]].tolist())
            assert kept == sorted(order[:budget]), (layer_idx, head)


def test_kvzap_global_budget_bytes_decode_and_codec(llama_file):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    params = dict(compression_ratio=0.75, calibration=str(llama_file))
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, "kvzap", **params), torch.no_grad():
        model(ids, cache=cache)
    kept = [layer.tokens_per_head() for _, layer in cache.kvpress_layers()]  # [B, Hkv] per layer
    per_row = sum(k.sum(-1) for k in kept)
    assert per_row.tolist() == [25 * 2 * 2]  # budget x layers x KV heads, spread unevenly
    assert len({int(k.max()) for k in kept} | {int(k.min()) for k in kept}) > 1
    per_token = 2 * 16 * 4  # K and V, head_dim 16, fp32
    assert sum(layer.kv_nbytes() for _, layer in cache.kvpress_layers()) == int(per_row.sum()) * per_token
    # decode_budget: generated tokens are cut by their predicted scores too
    with kvpress.patch_model(model, "kvzap", budget_allocation="uniform", decode_budget=6, **params):
        greedy(model, ids, 20)
    stats = kvpress.last_cache_stats(model)
    assert all(row["kept_max"] == 25 + 6 for row in stats["layers"])
    with kvpress.patch_model(model, "kvzap+kivi", group_size=8, residual_length=8, **params):
        greedy(model, ids, 4)
    low_bit = kvpress.last_cache_stats(model)["prefill_kv_bytes"]
    assert low_bit < sum(layer.kv_nbytes() for _, layer in cache.kvpress_layers())
    # a protected window: every head of every layer keeps the newest 8 tokens, within the same total
    windowed = KVPressCache(model.config)
    with kvpress.patch_model(model, "kvzap", window=8, **params), torch.no_grad():
        model(ids, cache=windowed)
    assert sum(layer.tokens_per_head().sum(-1) for _, layer in windowed.kvpress_layers()).tolist() == [25 * 2 * 2]
    for _, layer in windowed.kvpress_layers():
        for head in range(2):
            assert set(range(92, 100)) <= set(layer.key_positions()[0, head][layer.key_valid()[0, head]].tolist())


@pytest.mark.parametrize("policy, extra", [("kvzap", {}), ("kvzap+kivi", dict(group_size=8, residual_length=8))])
def test_decode_budget_on_the_tail_alone_keeps_what_the_whole_view_keeps(llama_file, policy, extra, monkeypatch):
    """decode_budget behind flat (global-budget) runs, and under a codec that flushes generated tokens out of the
    tail: a step that looks at the tail alone (and evicts in place there) generates the same tokens and keeps the
    same positions and bytes in every layer as the whole-view step; the tail path is really taken."""
    from kvpress import KVPressLayer

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    params = dict(compression_ratio=0.75, calibration=str(llama_file), decode_budget=6, **extra)

    def run():
        cache = KVPressCache(model.config)
        with kvpress.patch_model(model, policy, **params), torch.no_grad():
            tokens = greedy(model, ids, 40, cache=cache)
        kept = [sorted(layer.key_positions()[0, h][layer.key_valid()[0, h]].tolist())
                for _, layer in cache.kvpress_layers() for h in range(layer.num_kv_heads)]
        return tokens, kept, cache.nbytes()

    tail_steps = []
    real = KVPressLayer.generated_in_tail
    monkeypatch.setattr(KVPressLayer, "generated_in_tail", lambda self: tail_steps.append(real(self)) or tail_steps[-1])
    tail = run()
    assert sum(tail_steps) > 0
    monkeypatch.setattr(KVPressLayer, "generated_in_tail", lambda self: False)
    whole = run()
    assert tail[0].tolist() == whole[0].tolist() and tail[1] == whole[1] and tail[2] == whole[2]
    assert all(len([p for p in head if p >= 100]) <= 6 for head in tail[1])


# ---------------------------------------------------------------------------- head split
def test_head_split_streaming_heads_keep_sinks_and_window(llama_file):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 120), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    calibration = Calibration.load(llama_file)
    streaming = calibration.streaming_heads(0.5)
    order = calibration.head_error.flatten().argsort(stable=True)[:2]  # the 2 of 4 heads with the least error
    assert sorted(torch.cat([streaming[i] for i in calibration.layers]).nonzero().flatten().tolist()) == sorted(order.tolist())
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, "duo_attention", streaming_heads=0.5, window=16, slack=8,
                             calibration=str(llama_file)), torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        n_real = [120, 110]
        for layer_idx in calibration.layers:
            layer = cache.layers[layer_idx]
            for b in range(2):
                for h in range(2):
                    kept = sorted(layer.key_positions()[b, h][layer.key_valid()[b, h]].tolist())
                    real = list(range(120 - n_real[b], 120))
                    expected = real[:4] + real[-16:] if streaming[layer_idx][h] else real
                    assert kept == expected, (layer_idx, b, h)
        alone = KVPressCache(model.config)
        model(ids[:1], cache=alone)  # bytes: one row (a padded row gets filler slots, see layer.py)
        held = sum(layer.kv_nbytes() for _, layer in alone.kvpress_layers())
        assert held == sum(int(layer.tokens_per_head().sum()) for _, layer in alone.kvpress_layers()) * 2 * 16 * 4
        # decoding: a streaming head is cut back to sinks + window once it holds `slack` more
        out = ids
        for step in range(20):
            logits = model(out[:, -1:], attention_mask=torch.cat([mask, mask.new_ones(2, step + 1)], 1),
                           cache=cache).logits
            out = torch.cat([out, logits[:, -1:].argmax(-1)], 1)
            for layer_idx in calibration.layers:
                counts = cache.layers[layer_idx].tokens_per_head()
                assert bool((counts[:, streaming[layer_idx]] <= 4 + 16 + 8).all())
    # no streaming head: exactly the stock model
    stock = greedy(model, ids, 6, attention_mask=mask)
    with kvpress.patch_model(model, "duo_attention", streaming_heads=0.0, calibration=str(llama_file)):
        assert torch.equal(greedy(model, ids, 6, attention_mask=mask), stock)


def test_head_split_composes_with_a_codec(llama_file):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(6))
    with kvpress.patch_model(model, "duo_attention", streaming_heads=0.5, window=16, calibration=str(llama_file)):
        greedy(model, ids, 4)
    alone = kvpress.last_cache_stats(model)["prefill_kv_bytes"]
    with kvpress.patch_model(model, "duo_attention+kivi", streaming_heads=0.5, window=16, group_size=8,
                             residual_length=8, calibration=str(llama_file)):
        greedy(model, ids, 4)
    assert kvpress.last_cache_stats(model)["prefill_kv_bytes"] < alone / 2


# ---------------------------------------------------------------------------- query-aware chunked prefill
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_an_appended_question_changes_nothing_when_nothing_is_evicted(arch):
    """policy none: chunks judged with the question appended, then forgotten, leave exactly the stock model's
    tokens (sliding-window layers of Gemma-3 included), from the prompt's tail or from question_ids."""
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with kvpress.patch_model(model, "none", prefill_chunk_size=40, question_tokens=12):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), stock)
    with kvpress.patch_model(model, "none", prefill_chunk_size=40):
        cache = KVPressCache(model.config, question_ids=torch.randint(3, 128, (2, 10)))
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, stock)


@pytest.mark.parametrize("source", ["tail", "ids"])
def test_a_known_question_votes_in_every_chunk_and_is_never_kept(source):
    """SnapKV, 40-token chunks, the question (12 tokens) appended to each chunk: every layer ends at the budget
    exactly, never held more than budget + chunk + question, and kept none of the question's slots beyond the
    prompt; the question's queries changed the selection."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(8))
    question = ids[:, -12:] if source == "tail" else torch.randint(3, 128, (1, 12))
    kept = {}
    for name, kwargs in (("plain", {}), ("question", {"question_tokens": 12} if source == "tail" else {})):
        cache = KVPressCache(model.config, question_ids=question if name == "question" and source == "ids" else None)
        with record_held_tokens() as peak, kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=8,
                                                               prefill_chunk_size=40, **kwargs), torch.no_grad():
            model(ids, cache=cache)
        assert max(peak) <= 80 + 40 + 12
        for _, layer in cache.kvpress_layers():
            assert layer.seen == 160 and layer.tokens_per_head().tolist() == [[80, 80]]
            assert int(layer.key_positions().max()) < 160
        kept[name] = [layer.key_positions().sort(-1).values for _, layer in cache.kvpress_layers()]
    assert any(not torch.equal(a, b) for a, b in zip(kept["plain"], kept["question"]))


def test_question_inputs_are_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="question_tokens=8 .*prefill_chunk_size"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5, question_tokens=8)
    with pytest.raises(ValueError, match="question_tokens=0"):
        kvpress.patch_model(model, "snapkv", compression_ratio=0.5, prefill_chunk_size=32, question_tokens=0)
    with pytest.raises(ValueError, match="question_ids="):
        KVPressCache(model.config, question_ids=torch.zeros(4))
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 128, (1, 30))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5):  # one-shot: the question would be ignored
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            model(ids, cache=KVPressCache(model.config, question_ids=ids[:, -5:]))
    with kvpress.patch_model(model, "none", prefill_chunk_size=64):  # a prompt shorter than a chunk still hears it
        cache = KVPressCache(model.config, question_ids=torch.randint(3, 128, (1, 5)))
        with record_held_tokens() as held:
            model(ids, cache=cache)
        assert max(held) == 30 + 5 and cache.get_seq_length() == 30


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_kvzap_left_padded_row_keeps_what_it_keeps_alone(llama_file, allocation):
    """Row 1 is a shorter prompt behind left padding: in every layer and head it keeps exactly the positions it keeps
    when run alone (shifted by its padding), and generates the same tokens."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(9)
    long, short = torch.randint(3, 128, (1, 90), generator=g), torch.randint(3, 128, (1, 77), generator=g)
    pad = 90 - 77
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    params = dict(compression_ratio=0.6, budget_allocation=allocation, calibration=str(llama_file))
    with kvpress.patch_model(model, "kvzap", **params):
        batch_cache, alone_cache = KVPressCache(model.config), KVPressCache(model.config)
        batched = model.generate(ids, attention_mask=mask, cache=batch_cache, max_new_tokens=5,
                                 min_new_tokens=5, do_sample=False)
        alone = model.generate(short, attention_mask=torch.ones_like(short), cache=alone_cache,
                               max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert batched[1, 90:].tolist() == alone[0, 77:].tolist()
    for (_, b), (_, a) in zip(batch_cache.kvpress_layers(), alone_cache.kvpress_layers()):
        for h in range(2):
            kept_b = sorted((b.key_positions()[1, h][b.key_valid()[1, h]] - pad).tolist())
            kept_a = sorted(a.key_positions()[0, h][a.key_valid()[0, h]].tolist())
            assert kept_b == kept_a, h


def test_the_shipped_calibration_is_installed_but_never_overwrites_a_different_file(tmp_path, monkeypatch, capsys):
    """make models puts the shipped file beside the weights; a file already there that differs (an older shipped
    one, or the user's own) is kept, and the difference is said with the command that installs the shipped one."""
    from pathlib import Path

    from kvpress import models
    from kvpress.calibration import FILE_NAME

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    (tmp_path / "smollm2").mkdir()
    target = tmp_path / "smollm2" / FILE_NAME
    shipped = Path(models.__file__).parent / "calibrations" / "smollm2.safetensors"
    models.install_calibration("smollm2")
    assert target.read_bytes() == shipped.read_bytes()
    target.write_bytes(b"the user's own calibration")
    capsys.readouterr()
    models.install_calibration("smollm2")
    assert target.read_bytes() == b"the user's own calibration"
    assert "differs from the calibration shipped" in capsys.readouterr().out


def test_a_hybrid_models_calibration_covers_the_layers_kvpress_compresses(tmp_path):
    """Gemma-3: sliding-window layers stay transformers' own, so its calibration covers the full-attention layers and
    every calibrated policy runs on it (they were refused: the file's layers differed from the model's list); a cache
    built without the config, which would compress the sliding layers too, is refused."""
    model = tiny_model("gemma3")
    calibration = calibrate(model, TOK, n_texts=3, n_tokens=120, held_out=1, tokens_per_text=80, codebook_stages=2,
                            log=lambda *a: None)
    assert calibration.layers == [1]
    path = tmp_path / "gemma.safetensors"
    calibration.save(path)
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(3))
    for policy, params in (("kvzap", dict(compression_ratio=0.5)), ("duo_attention", {}), ("less", dict(budget=20)),
                           ("double_sparsity", dict(budget=16)), ("commvq", dict(residual_length=8, block_size=8)),
                           ("lserve", dict(budget=32, page_size=8, local=8, n_sink=2))):
        with kvpress.patch_model(model, policy=policy, calibration=str(path), **params):
            cache = KVPressCache(model.config)
            greedy(model, ids, 4, cache=cache)
            assert [i for i, _ in cache.kvpress_layers()] == [1]
    with kvpress.patch_model(model, policy="kvzap", compression_ratio=0.5, calibration=str(path)):
        with pytest.raises(ValueError, match=r"KVPressCache\(model.config\)"):
            greedy(model, ids, 2, cache=KVPressCache())
