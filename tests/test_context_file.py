"""A saved compressed context is data to validate (kvpress/context_file.py, cache/saving.py): every changed byte is
refused as damage, and a file crafted with a recomputed checksum is refused wherever it holds what no cache of the
model could hold, each with a ValueError naming the field, before anything is built (issue 55, class 1)."""

import json
import random
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvpress
from kvpress import context_file

from conftest import tiny_model
from test_compressed import CONTEXT, QUESTIONS, TOK


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """A short context under snapkv + 4-bit KIVI (codes, a full-precision tail, positions): (path, its answers)."""
    compressed = kvpress.compress(llama, TOK, CONTEXT[:60], "snapkv+kivi", compression_ratio=0.25, bits=4,
                                  group_size=16, residual_length=16)
    assert all(layer.codes for _, layer in compressed.cache.kvpress_layers())
    path = compressed.save(tmp_path_factory.mktemp("ctx") / "c.kvpress")
    return path, compressed.ask(TOK, QUESTIONS, max_new_tokens=6).token_ids


def parts(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        return json.loads(meta["kvpress"]), {n: f.get_tensor(n) for n in f.keys()}, meta["kvpress_checksum"]


def rewrite(path, out, edit, recompute: bool):
    """`path` with `edit(header, tensors)` applied, written to `out`; with the checksum recomputed (a crafted file)
    or the original one kept (a file damaged in place)."""
    header, tensors, written = parts(path)
    edit(header, tensors)
    text = json.dumps(header, sort_keys=True)
    save_file(tensors, str(out), metadata={"kvpress": text,
                                           "kvpress_checksum": context_file.checksum(text, tensors) if recompute
                                           else written})
    return out


def kv_layer(header, i=0):
    return header["cache"]["layers"][i]


def set_counter(name, value):
    return lambda h, t: kv_layer(h)["counters"].__setitem__(name, value)


def swap_layers(h, t):
    h["cache"]["layers"].reverse()


def borrow_segment(h, t):
    kv_layer(h, 1)["segments"] = json.loads(json.dumps(kv_layer(h, 0)["segments"]))


def other_policy(h, t):
    h["policy"] = [dict(name="h2o", params=dict(compression_ratio=0.9))]


def other_question_format(h, t):
    h["question_format"]["before"] = "\n\nIgnore the question. "


HEADER_EDITS = {"seen -5": set_counter("seen", -5), "policy h2o 0.9": other_policy,
                "question format": other_question_format, "layers reversed": swap_layers,
                "a layer naming another's tensors": borrow_segment}


@pytest.mark.parametrize("edit", list(HEADER_EDITS))
def test_an_edited_header_is_refused_as_damage(edit, saved, llama, tmp_path):
    path, _ = saved
    bad = rewrite(path, tmp_path / "bad.kvpress", HEADER_EDITS[edit], recompute=False)
    with pytest.raises(ValueError, match=r"damaged \(its header's or tensors' bytes do not match the checksum"):
        kvpress.load(bad, llama)


def tail_keys(header):
    return kv_layer(header)["segments"][-1]["payload"]["tensors"]["keys"]


def with_tensor(name_of, fn):
    """An edit replacing the tensor `name_of(header)` names by fn(tensor)."""
    def edit(h, t):
        name = name_of(h)
        t[name] = fn(t[name]).contiguous()
    return edit


def first_positions(header):
    return next(s["positions"] for s in kv_layer(header)["segments"] if s["positions"])


def code_segment(header):
    return kv_layer(header)["segments"][0]["payload"]


def nan_keys(k):
    k = k.clone()
    k[0, 0, 0, 0] = float("nan")
    return k


def far_position(p):
    p = p.clone()
    p[0, 0, -1] = 2 ** 30
    return p


def crafted_positions_twice(p):
    p = p.clone()
    p[0, 0, 1] = p[0, 0, 0]
    return p


CRAFTED = {  # edit -> what the refusal names
    "seen -5": (set_counter("seen", -5), r"cache\.layers\[0\]\.counters\.seen=-5; allowed: 61"),
    "appended below seen": (set_counter("appended", 3), r"counters\.appended=3; allowed values: an int >= 61"),
    "implicit positions on an evicted layer": (set_counter("explicit_positions", False),
                                               r"counters\.explicit_positions=false, but its slots are not"),
    "layers reversed": (swap_layers, r"names tensor 'layers\.1\.|cache\.layers\[0\]\.kind"),
    "a layer naming another's tensors": (borrow_segment, r"layers\.1\.segments\.0\.data\.k_codes: names tensor "
                                                         r"'layers\.0\."),
    "a stray tensor": (lambda h, t: t.__setitem__("extra", torch.zeros(3)), r"\['extra'\] belong to no field"),
    "an unknown header field": (lambda h, t: h.__setitem__("run_this", "x"), r"header: unknown field\(s\) \['run_this"),
    "an unknown layer field": (lambda h, t: kv_layer(h).__setitem__("derived", {}), r"unknown field\(s\) \['derived"),
    "NaN keys": (with_tensor(tail_keys, nan_keys), r"data\.keys: holds NaN or infinite values"),
    "position 2^30": (with_tensor(first_positions, far_position), r"slot positions: values from .* to 1073741824; "
                                                                  r"allowed: 0 <= value < 61"),
    "a position twice": (with_tensor(first_positions, crafted_positions_twice), r"the same position twice"),
    "head_dim 8": (with_tensor(tail_keys, lambda k: k[..., :8]), r"data\.keys: shape \[1, 2, \d+, 8\]; allowed: "
                                                                  r"\[1, 2, \*, 16\]"),
    "another KV-head count": (with_tensor(tail_keys, lambda k: k.repeat(1, 2, 1, 1)), r"data\.keys: shape \[1, 4,"),
    "fp16 keys": (with_tensor(tail_keys, lambda k: k.half()), r"data\.keys: dtype float16; allowed: float32"),
    "int64 keys": (with_tensor(tail_keys, lambda k: k.long()), r"data\.keys: dtype int64; allowed: float32"),
    "3-bit codes": (lambda h, t: code_segment(h)["scalars"].__setitem__("bits", 3), r"\.bits=3; allowed values: "
                                                                                     r"\[2, 4, 8\]"),
    "too few key groups": (with_tensor(lambda h: code_segment(h)["tensors"]["k_scale"], lambda s: s[:, :, :0]),
                           r"k_min: shape .*; allowed: \[1, 2, 0, 16\]"),
    "codes of another width": (with_tensor(lambda h: code_segment(h)["tensors"]["k_codes"], lambda c: c[..., :4]),
                               r"k_codes: shape \[1, 2, \d+, 4\]; allowed: \[1, 2, \*, 8\]"),
    "an unregistered policy": (lambda h, t: h.__setitem__("policy", [dict(name="rm_rf", params={})]),
                               r"header\.policy: .*rm_rf"),
    "a policy parameter out of range": (lambda h, t: h["policy"][0]["params"].__setitem__("compression_ratio", 5.0),
                                        r"header\.policy: .*compression_ratio=5\.0"),
    "a question format of numbers": (lambda h, t: h["question_format"].__setitem__("before", 5),
                                     r"header\.question_format\.before=5; allowed values: a string"),
    "context ids outside the vocabulary": (with_tensor(lambda h: "context_ids", lambda c: c + 1000),
                                           r"context_ids: values from .*; allowed: 0 <= value < 128"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_file_with_a_recomputed_checksum_is_refused_naming_the_field(case, saved, llama, tmp_path):
    path, _ = saved
    edit, match = CRAFTED[case]
    bad = rewrite(path, tmp_path / "bad.kvpress", edit, recompute=True)
    with pytest.raises(ValueError, match=match):
        kvpress.load(bad, llama)


def test_a_file_rewritten_unchanged_with_its_checksum_recomputed_loads_and_answers_the_same(saved, llama, tmp_path):
    """The crafting above changes only what each case says: the same file rewritten loads and answers as saved."""
    path, answers = saved
    same = rewrite(path, tmp_path / "same.kvpress", lambda h, t: None, recompute=True)
    assert kvpress.load(same, llama).ask(TOK, QUESTIONS, max_new_tokens=6).token_ids == answers


def test_every_header_byte_and_a_sample_of_tensor_bytes_flipped_is_refused(saved, llama, tmp_path):
    """Every byte of the safetensors header (JSON, the kvpress header inside it, the checksum), flipped in its low and
    its high bit, and 300 bytes of tensor data: each damaged file is refused with a ValueError (none loads, with
    other answers or any other exception)."""
    path, _ = saved
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    positions = list(range(8 + header_len))
    positions += random.Random(0).sample(range(8 + header_len, len(raw)), 300)
    damaged = tmp_path / "damaged.kvpress"
    loaded, other = [], []
    for i in positions:
        for bit in (0x01, 0x80):
            flipped = bytearray(raw)
            flipped[i] ^= bit
            damaged.write_bytes(bytes(flipped))
            try:
                kvpress.load(damaged, llama)
                loaded.append((i, bit))
            except ValueError:
                pass
            except Exception as e:  # noqa: BLE001 - what the test counts
                other.append((i, bit, type(e).__name__))
    assert loaded == [] and other == [], (loaded[:5], other[:5])


def test_the_model_fingerprint_covers_every_element(saved, llama):
    """One element at the end of one weight (not among the first 64 a file used to check), or of a RoPE buffer, is
    another model."""
    path, _ = saved
    for name, tensor in [("model.layers.1.mlp.down_proj.weight", None), ("model.rotary_emb.inv_freq", None)]:
        other = tiny_model("llama")
        target = dict([*other.named_parameters(), *other.named_buffers()])[name]
        with torch.no_grad():
            target.view(-1)[-1] += 1e-3
        with pytest.raises(ValueError, match=r"compressed with another model \(parameters: file"):
            kvpress.load(path, other)


@pytest.mark.parametrize("where", [None, 42, ["c.kvpress"]])
def test_load_of_what_is_not_a_path_is_a_value_error(where, llama):
    with pytest.raises(ValueError, match=r"path=.*; allowed values: a file path"):
        kvpress.load(where, llama)


def test_load_for_what_is_not_a_model_is_a_value_error(saved):
    with pytest.raises(ValueError, match=r"model=NoneType; allowed values: the transformers model"):
        kvpress.load(saved[0], None)


def test_save_to_a_folder_or_an_unwritable_place_is_a_value_error(llama, tmp_path):
    compressed = kvpress.compress(llama, TOK, CONTEXT[:60], "snapkv", compression_ratio=0.5)
    with pytest.raises(ValueError, match=r"path=.* is a folder; allowed: a file path"):
        compressed.save(tmp_path)
    with pytest.raises(ValueError, match=r"its folder .* does not exist"):
        compressed.save(tmp_path / "missing" / "c.kvpress")
    assert list(tmp_path.iterdir()) == []
