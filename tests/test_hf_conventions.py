"""transformers' own conventions hold on a patched model (issue 58): what it saves is a plain checkpoint, with no
kvpress object in its config or generation config, and it loads back as the stock model."""

import json

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import kvpress
from conftest import tiny_model


def test_a_patched_model_saves_a_plain_checkpoint(tmp_path):
    model = tiny_model("llama")
    config, generation = model.config.to_json_string(), model.generation_config.to_json_string()
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    stock = model.generate(ids, max_new_tokens=6, do_sample=False)
    kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    assert model.config.to_json_string() == config and model.generation_config.to_json_string() == generation
    model.save_pretrained(tmp_path)
    for name in ("config.json", "generation_config.json"):
        text = (tmp_path / name).read_text()
        assert "kvpress" not in text.lower() and "policy" not in text, name
        json.loads(text)  # (plain JSON: nothing that only kvpress can read)
    assert GenerationConfig.from_pretrained(tmp_path).to_json_string() == generation
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False), stock)  # the stock model again
