"""Layer-skip drafts (speculative/layer_skip.py): greedy output equals plain greedy whatever is skipped, the skipped
layers' attention never runs for a draft token (so they get no draft KV), CLaSp's choice finds a layer that changes
nothing, and bad settings are refused before anything runs."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpress
from kvpress.speculative.layer_skip import clasp_choice, decoder_layers

from conftest import tiny_model

SIX = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def six_layers(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SIX)).eval()


def batch():
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("settings", [
    dict(draft=None, skip_layers=[2, 3]),  # a fixed set, the whole cache read
    dict(draft=None, skip_layers=3),  # CLaSp, chosen again every round
    dict(draft=None, skip_layers=2, reselect_every=3),
    dict(draft="sink_window", skip_layers=2, draft_budget=16),  # skipping layers and reading a view
])
def test_greedy_with_layers_skipped_equals_plain_greedy(settings):
    model = six_layers()
    ids, mask = batch()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
    out, stats = kvpress.speculative_generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], pad_token_id=0,
                                              gamma=3, return_stats=True, **settings)
    assert torch.equal(out, plain)
    assert stats.rounds > 0 and stats.skipped_layers
    assert all(0 not in chosen for chosen in stats.skipped_layers)
    if isinstance(settings["skip_layers"], int):
        assert all(len(chosen) == settings["skip_layers"] for chosen in stats.skipped_layers)


def test_a_skipped_layer_runs_no_attention_for_draft_tokens():
    """Attention calls per layer: the prompt, then every verification; a layer that is not skipped also runs each
    draft step. (Its draft KV is then rolled back; the skipped layer never had any.)"""
    model = six_layers()
    ids, mask = batch()
    calls = {}
    attention = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")}
    handles = [m.register_forward_hook(lambda mod, *_: calls.__setitem__(mod.layer_idx, calls.get(mod.layer_idx, 0) + 1))
               for m in attention.values()]
    try:
        _, stats = kvpress.speculative_generate(model, ids, mask, draft=None, skip_layers=[2, 3], gamma=3,
                                                max_new_tokens=20, eos_token_id=[], return_stats=True)
    finally:
        for h in handles:
            h.remove()
    draft_steps = stats.drafted // ids.shape[0]
    assert calls[2] == calls[3] == 1 + stats.rounds
    assert calls[1] == calls[4] == 1 + stats.rounds + draft_steps and draft_steps > 0


def test_clasp_chooses_a_layer_that_changes_nothing():
    """A layer whose attention output and MLP output are zero passes its input through: skipping it loses nothing,
    so CLaSp's programme, asked for one layer, picks it (and never layer 0). The programme runs each layer over its
    candidates with no context (each attends to itself only, the paper's approximation); over a one-token input
    that is exact, so the full model's own hidden states are the programme's unskipped path."""
    model = six_layers(seed=1)
    layers = decoder_layers(model)
    with torch.no_grad():
        layers[4].self_attn.o_proj.weight.zero_()
        layers[4].mlp.down_proj.weight.zero_()
    ids = torch.tensor([[17]])
    hidden = [h[:, -1] for h in model(ids, output_hidden_states=True).hidden_states]
    chosen = clasp_choice(layers, hidden, 1, model.model.rotary_emb, model.model.norm)
    assert chosen == (4,)
    assert len(clasp_choice(layers, hidden, 3, model.model.rotary_emb, model.model.norm)) == 3


@pytest.mark.parametrize("settings, message", [
    (dict(skip_layers=0), r"skip_layers=0; allowed values: None, an int in \[1, 5\]"),
    (dict(skip_layers=6), r"skip_layers=6"),
    (dict(skip_layers=[0, 2]), r"layer 0 runs in every draft"),
    (dict(skip_layers=[2, 2]), r"distinct layer indices"),
    (dict(skip_layers=2, reselect_every=0), r"reselect_every=0; allowed values: an int >= 1"),
    (dict(draft=None), r"draft=None reads the whole cache, which drafts only with layers skipped"),
    (dict(draft=None, skip_layers=2, page_size=8), r"draft=None reads the whole cache: \['page_size'\]"),
])
def test_bad_layer_skip_settings_are_refused_before_anything_runs(settings, message):
    model = six_layers()
    with pytest.raises(ValueError, match=message):
        kvpress.speculative_generate(model, torch.randint(3, 128, (1, 30)), **settings)
    assert model.config._attn_implementation == "sdpa"


def test_a_model_with_sliding_window_layers_is_refused():
    model = tiny_model("gemma3")
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvpress.speculative_generate(model, torch.randint(3, 128, (1, 30)), draft=None, skip_layers=[1])


def test_an_adaptive_speculation_length_follows_acceptance_and_stays_lossless():
    """gamma="adaptive" (every draft kind): 4 drafts first, two more after a round all accepted, one fewer after a
    rejection, between 1 and 16; greedy output is still plain greedy's."""
    from kvpress.speculative.generate import Length

    length = Length("adaptive")
    assert length.now == 4
    length.update(4, 4)
    assert length.now == 6
    length.update(6, 2)
    assert length.now == 5
    for _ in range(20):
        length.update(length.now, length.now)
    assert length.now == 16
    model = six_layers()
    ids, mask = batch()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[],
                           pad_token_id=0)
    for settings in (dict(draft=None, skip_layers=[2]), dict(draft="sink_window", draft_budget=16)):
        out, stats = kvpress.speculative_generate(model, ids, mask, gamma="adaptive", max_new_tokens=24,
                                                  eos_token_id=[], pad_token_id=0, return_stats=True, **settings)
        assert torch.equal(out, plain)
        assert stats.per_round_drafts[0] == 4 and len(set(stats.per_round_drafts)) > 1
    with pytest.raises(ValueError, match="gamma='fast'; allowed values: an int >= 1, or 'adaptive'"):
        kvpress.speculative_generate(model, ids, gamma="fast")


def test_skipping_is_per_thread_and_the_layers_are_put_back_whatever_the_order():
    """Two calls skipping the same layer, left in either order, leave the layer's own forward; while one skips it,
    another thread runs it (its output is the plain model's)."""
    import threading

    from kvpress.speculative.layer_skip import skipping

    model = six_layers()
    layers = decoder_layers(model)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    plain = model(ids).logits
    first, second = skipping(layers, [2]), skipping(layers, [2])
    first.__enter__()
    second.__enter__()
    seen = {}
    worker = threading.Thread(target=lambda: seen.setdefault("logits", model(ids).logits))
    worker.start()
    worker.join()
    assert torch.equal(seen["logits"], plain)  # the other thread ran layer 2
    assert not torch.equal(model(ids).logits, plain)  # this one skipped it
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert "forward" not in layers[2].__dict__ and torch.equal(model(ids).logits, plain)


def test_compare_survives_a_stop_at_eos_inside_a_round():
    model = six_layers()
    ids, mask = batch()
    plain = model.generate(ids[:1], max_new_tokens=20, do_sample=False, eos_token_id=[], pad_token_id=0)
    eos = int(plain[0, ids.shape[1] + 5])  # a token greedy decoding produces early
    out, stats = kvpress.speculative_generate(model, ids[:1], draft=None, skip_layers=[2], gamma=4, max_new_tokens=20,
                                              eos_token_id=eos, pad_token_id=0, return_stats=True, compare=True)
    assert int(out[0, -1]) == eos and stats.plain_matches is True


def test_clasp_runs_under_a_callers_chunked_prefill_patch():
    """CLaSp's first choice comes from the first verification, so a caller's chunked prefill (which returns no
    hidden states) works, and greedy stays plain greedy's."""
    model = six_layers()
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(6))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5, window_size=8, prefill_chunk_size=32):
        plain = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0)
        out, stats = kvpress.speculative_generate(model, ids, draft=None, skip_layers=2, max_new_tokens=12,
                                                  eos_token_id=[], pad_token_id=0, return_stats=True)
    assert torch.equal(out, plain) and stats.skipped_layers
