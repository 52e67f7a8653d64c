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
