"""kvpress.compress / ask / load: questions batched on one compressed context answer as each asked alone; a saved
and reloaded context answers as the original, for every storage kind; wrong files, models and arguments are
refused before anything runs."""

import json
import struct

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.questions import split_prompt

from conftest import tiny_model

CONTEXT = "The cooperative was founded in 1987 by twelve farmers in Millbrook; its mascot is a heron named Pip. " * 2
QUESTIONS = ["Who?", "What is the name of the mascot?", "When was it founded, and by whom?"]


class CharTokenizer:
    """Characters as ids (vocab 128), no chat template: enough for tiny random models."""

    chat_template = None
    eos_token_id, pad_token_id = 2, 0

    def encode(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + [3 + ord(c) % 120 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + (i - 3) % 95) for i in ids if i > 2)


TOK = CharTokenizer()
# every storage kind: rectangular evicted, flat (per-head runs), low-bit (rectangular and flat), composed, GEAR,
# one code segment per width (ZipCache)
STORAGE = {
    "evicted": ("snapkv", dict(compression_ratio=0.5)),
    "flat": ("snapkv", dict(compression_ratio=0.5, budget_allocation="adaptive")),
    "global": ("kvzip", dict(compression_ratio=0.5, chunk_size=64)),
    "low_bit": ("kivi", dict(bits=4, group_size=16, residual_length=16)),
    "composed": ("snapkv+kivi", dict(compression_ratio=0.5, bits=2, group_size=16, residual_length=16)),
    "flat_low_bit": ("snapkv+kivi", dict(compression_ratio=0.5, budget_allocation="adaptive", bits=4,
                                         group_size=16, residual_length=16)),
    "gear": ("keydiff+gear", dict(compression_ratio=0.5, bits=4, group_size=16, residual_length=16)),
    "decode_eviction": ("h2o", dict(compression_ratio=0.5)),
    "mixed_width": ("snapkv+zipcache", dict(compression_ratio=0.5, budget_allocation="adaptive", group_size=16)),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _same_layers(a: kvpress.KVPressCache, b: kvpress.KVPressCache) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb)
        if isinstance(la, kvpress.KVPressLayer):
            assert (la.seen, la.view_width, la.nbytes()) == (lb.seen, lb.view_width, lb.nbytes())
            assert torch.equal(la.key_positions(), lb.key_positions()) and torch.equal(la.key_valid(), lb.key_valid())
            assert torch.equal(la.keys_view(), lb.keys_view())
        else:
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", list(STORAGE))
def test_batched_equals_alone_and_a_reloaded_context_answers_the_same(arch, kind, tmp_path):
    model = tiny_model(arch)
    policy, params = STORAGE[kind]
    compressed = kvpress.compress(model, TOK, CONTEXT, policy, **params)
    assert compressed.nbytes() < compressed.full_cache_nbytes()
    batched = compressed.ask(TOK, QUESTIONS, max_new_tokens=12)
    alone = [compressed.ask(TOK, q, max_new_tokens=12).token_ids[0] for q in QUESTIONS]
    assert batched.token_ids == alone
    assert batched.context_bytes == compressed.nbytes() and batched.context_tokens == compressed.context_tokens

    path = compressed.save(tmp_path / "context.kvpress")
    later = kvpress.load(path, model)
    _same_layers(compressed.cache, later.cache)
    assert later.policy == compressed.policy and later.nbytes() == compressed.nbytes()
    assert later.ask(TOK, QUESTIONS, max_new_tokens=12).token_ids == batched.token_ids


def test_the_full_cache_answers_as_plain_transformers(llama):
    """Independent reference: the unpatched model generating on each whole prompt with a stock cache."""
    answers = kvpress.ask(llama, TOK, CONTEXT, QUESTIONS, policy="none", max_new_tokens=10)
    context_ids, fmt = split_prompt(TOK, CONTEXT)
    for question, got in zip(QUESTIONS, answers.token_ids):
        ids = torch.cat([context_ids, torch.tensor([fmt.ids(TOK, question)])], 1)
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=llama.config),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert got == out[:len(got)] and (len(got) == len(out) or out[len(got)] == TOK.eos_token_id)
    assert answers.bytes_fraction == 1.0 and answers.kept_fraction == 1.0


def test_a_file_for_another_model_dtype_or_tokenizer_is_refused(llama, tmp_path):
    path = kvpress.compress(llama, TOK, CONTEXT, "snapkv", compression_ratio=0.5).save(tmp_path / "c.kvpress")
    with pytest.raises(ValueError, match="another model.*parameters"):
        kvpress.load(path, tiny_model("llama", seed=1))
    with pytest.raises(ValueError, match="another model.*model_type"):
        kvpress.load(path, tiny_model("qwen2"))
    with pytest.raises(ValueError, match="holds a float32 cache; the model runs in bfloat16"):
        kvpress.load(path, tiny_model("llama").to(torch.bfloat16))

    class OtherTokenizer(CharTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [4 + ord(c) % 110 for c in text]
    with pytest.raises(ValueError, match="tokenizer: not the tokenizer this context was compressed with"):
        kvpress.load(path, llama).ask(OtherTokenizer(), QUESTIONS)


def test_damaged_truncated_and_foreign_files_are_refused(llama, tmp_path):
    path = kvpress.compress(llama, TOK, CONTEXT, "snapkv", compression_ratio=0.5).save(tmp_path / "c.kvpress")
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    flipped = bytearray(raw)
    flipped[8 + header_len + 100] ^= 0xFF  # one byte of tensor data
    (tmp_path / "flipped").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="damaged"):
        kvpress.load(tmp_path / "flipped", llama)
    (tmp_path / "truncated").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match="not a readable kvpress context file"):
        kvpress.load(tmp_path / "truncated", llama)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a readable kvpress context file"):
        kvpress.load(tmp_path / "plain.safetensors", llama)
    header = json.loads(raw[8:8 + header_len])
    meta = json.loads(header["__metadata__"]["kvpress"])
    meta["version"] = 99
    header["__metadata__"]["kvpress"] = json.dumps(meta)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    (tmp_path / "future").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + header_len:])
    with pytest.raises(ValueError, match="version 99; this kvpress reads"):
        kvpress.load(tmp_path / "future", llama)
    with pytest.raises(FileNotFoundError, match="no such file"):
        kvpress.load(tmp_path / "missing", llama)


def test_bad_arguments_are_refused_before_anything_runs(llama):
    compressed = kvpress.compress(llama, TOK, CONTEXT, "snapkv", compression_ratio=0.5)
    before = compressed.cache.nbytes()
    for bad, match in [(dict(questions=[]), "questions="), (dict(questions=["ok", ""]), "question=''"),
                       (dict(questions="q", max_new_tokens=0), "max_new_tokens=0"),
                       (dict(questions="q", batch_size=0), "batch_size=0")]:
        with pytest.raises(ValueError, match=match):
            compressed.ask(TOK, **bad)
    assert compressed.cache.nbytes() == before and not kvpress.integrations.registry.patch_of(llama)
    with pytest.raises(ValueError, match="compression_ratio=1.5"):
        kvpress.compress(llama, TOK, CONTEXT, "snapkv", compression_ratio=1.5)
    with pytest.raises(ValueError, match="context="):
        kvpress.compress(llama, TOK, "", "snapkv", compression_ratio=0.5)
    with pytest.raises(ValueError, match="compression_ratio=None"):
        kvpress.compress(llama, TOK, CONTEXT, "snapkv")
    with pytest.raises(ValueError, match="chat_template=True, but the tokenizer has no chat template"):
        kvpress.compress(llama, TOK, CONTEXT, "snapkv", chat_template=True, compression_ratio=0.5)


def test_questions_in_batches_answer_as_one_batch(llama):
    compressed = kvpress.compress(llama, TOK, CONTEXT, "keydiff", compression_ratio=0.75)
    whole = compressed.ask(TOK, QUESTIONS, max_new_tokens=8)
    assert compressed.ask(TOK, QUESTIONS, max_new_tokens=8, batch_size=2).token_ids == whole.token_ids
    assert whole.decode_steps >= 1 and whole.question_s > 0 and list(whole) == whole.answers


@pytest.mark.real_model
def test_smollm2_compress_once_ask_many(smollm2, tmp_path):
    """The chat template is applied; kvzap+kivi: batched == alone == after save and load; the full cache ==
    plain transformers on each whole templated prompt."""
    model, tokenizer = smollm2
    LONG = CONTEXT * 20  # about 1K tokens
    questions = ["Who founded the cooperative?", "What is the mascot called?"]
    compressed = kvpress.compress(model, tokenizer, LONG, "kvzap+kivi", compression_ratio=0.75, bits=4)
    assert compressed.nbytes() < 0.25 * compressed.full_cache_nbytes()
    batched = compressed.ask(tokenizer, questions, max_new_tokens=16)
    assert batched.token_ids == [compressed.ask(tokenizer, q, max_new_tokens=16).token_ids[0] for q in questions]
    later = kvpress.load(compressed.save(tmp_path / "doc.kvpress"), model)
    assert later.ask(tokenizer, questions, max_new_tokens=16).token_ids == batched.token_ids

    full = kvpress.ask(model, tokenizer, LONG, questions, policy="none", max_new_tokens=16)
    for question, got in zip(questions, full.token_ids):
        text = tokenizer.apply_chat_template([{"role": "user", "content": LONG + "\n\n" + question}],
                                             tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert got == out[0, ids.shape[1]:].tolist()[:len(got)]


def test_generate_given_only_the_question_after_a_compressed_document_says_what_to_pass(llama):
    """It failed deep inside transformers with "cannot reshape tensor of 0 elements"."""
    context_ids, fmt = split_prompt(TOK, CONTEXT)
    question = torch.tensor([fmt.ids(TOK, "Who?")])
    cache = kvpress.KVPressCache(llama.config)
    with kvpress.patch_model(llama, "snapkv", compression_ratio=0.5), torch.no_grad():
        llama(input_ids=context_ids, cache=cache)
        before = cache.nbytes()
        with pytest.raises(ValueError, match=r"input_ids has 24 tokens per row, but the cache given has already seen"):
            llama.generate(question, attention_mask=torch.ones_like(question), cache=cache, max_new_tokens=4)
    assert cache.nbytes() == before and cache.get_seq_length() == context_ids.shape[1]
