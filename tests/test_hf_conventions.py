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


def test_the_hub_style_custom_generate_folder_loads_by_local_path():
    """transformers' convention: a folder with custom_generate/generate.py, loaded by path (code: trust_remote_code).
    kvpress ships one for self-speculation; its greedy output is plain greedy's."""
    import pytest

    from kvpress.speculative import HUB_FOLDER, last_stats

    assert (HUB_FOLDER / "custom_generate" / "generate.py").is_file()
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, custom_generate=str(HUB_FOLDER),
                         trust_remote_code=True, draft="sink_window", gamma=3, draft_budget=16)
    assert torch.equal(out, plain) and last_stats(model).rounds > 0
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers' own gate: it is code
        model.generate(ids, max_new_tokens=4, custom_generate=str(HUB_FOLDER))


def test_continuous_batching_and_other_cache_implementations_are_refused_on_a_patched_model():
    """transformers' continuous batching runs its own paged cache and attention, which kvpress does not compress:
    refused, saying what to use, and the patch is left as it was; unpatched, it runs as stock."""
    import pytest
    from transformers import GenerationConfig

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=0)
    stock = model.generate(ids, max_new_tokens=4, do_sample=False)
    patch = kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    for run in (lambda: model.generate_batch([ids[0].tolist()], generation_config=config),
                lambda: model.generate(ids, max_new_tokens=4, cache_implementation="paged"),
                lambda: model.init_continuous_batching(generation_config=config)):
        with pytest.raises(ValueError, match=r"continuous batching .* kvpress does not compress .*kvpress serve"):
            run()
    for implementation in ("static", "offloaded", "quantized", "hybrid", "sliding_window"):
        with pytest.raises(ValueError, match=f"cache_implementation='{implementation}'.*allowed values: None or "
                                             f"'dynamic'"):
            model.generate(ids, max_new_tokens=4, cache_implementation=implementation)
    assert model.config._attn_implementation.startswith("kvpress")
    dynamic = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="dynamic")
    assert all(layer["stored"] < ids.shape[1] for layer in kvpress.last_cache_stats(model)["layers"])  # compressed
    assert torch.equal(dynamic, model.generate(ids, max_new_tokens=4, do_sample=False))
    patch.unpatch()
    got = model.generate_batch([ids[0].tolist()], generation_config=config)
    assert next(iter(got.values())).generated_tokens == stock[0, ids.shape[1]:].tolist()


def test_a_cache_implementation_set_in_a_generation_config_is_handled_as_the_argument_is():
    import pytest

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    kvpress.patch_model(model, "snapkv", compression_ratio=0.5)
    given = GenerationConfig(cache_implementation="dynamic", max_new_tokens=4, do_sample=False, eos_token_id=2,
                             pad_token_id=0)
    out = model.generate(ids, generation_config=given)
    assert given.cache_implementation == "dynamic"  # (the caller's config is not changed)
    assert all(layer["stored"] < ids.shape[1] for layer in kvpress.last_cache_stats(model)["layers"])
    model.generation_config.cache_implementation = "dynamic"
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), out)
    with pytest.raises(ValueError, match="generation_config.cache_implementation='static'"):
        model.generate(ids, generation_config=GenerationConfig(cache_implementation="static", max_new_tokens=4))
