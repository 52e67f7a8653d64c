"""Layer-skip drafts: the draft is the model with some decoder layers skipped (CLaSp, Chen et al. ACL 2025,
arXiv 2505.24196; docs: ../shared/docs/policies.md 13.7).

A skipped layer passes its input through: its attention does not run, so the draft's tokens get no KV in that layer
(nothing written, nothing to roll back there), and its weights are not read, which is what a draft step on a CPU or
at moderate context mostly pays for. The verification runs every layer over [last token, drafts], as for any draft.

Which layers: a fixed set, or CLaSp's choice, made again from the last verification's own hidden states: a dynamic
programme over the layers keeps, for each number j of layers skipped so far, the hidden state closest (cosine) to
the full model's at that depth; layer i is applied to every candidate in one call, the candidates attending only
to themselves (the paper's approximation: no context, so the choice costs about one step over M + 1 tokens).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..integrations.hf import decoder_of


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of `model` in order: the modules whose direct child is an attention module (layer_idx)."""
    layers = {}
    for module in model.modules():
        for child in module.children():
            if hasattr(child, "layer_idx") and hasattr(child, "is_causal"):
                layers[child.layer_idx] = module
    return [layers[i] for i in sorted(layers)]


# The layers the drafts of this thread (context) skip now. A layer passes its input through only where its thread
# asks: calls on other threads that share the model (the one-call API's shared patch, a plain generate beside it)
# run it as always.
_SKIPPED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("kvpress_skipped_layers", default=frozenset())
_LOCK = threading.Lock()
_INSTALLED: dict = {}  # id(layer) -> [layer, its own instance forward (or None), the calls using the wrapper]


def _wrapper(layer, forward):
    def skippable_forward(hidden_states, *args, **kwargs):
        if id(layer) in _SKIPPED.get():
            return hidden_states
        return forward(hidden_states, *args, **kwargs)

    return skippable_forward


@contextlib.contextmanager
def skipping(layers: list[torch.nn.Module], skipped) -> Iterator[None]:
    """The layers at indices `skipped` pass their input through, for this thread, while the block runs. Each layer
    gets a wrapper while some call needs it; the last call out puts the layer's own forward back."""
    targets = [layers[i] for i in skipped]
    with _LOCK:
        for layer in targets:
            entry = _INSTALLED.get(id(layer))
            if entry is None:
                own = layer.__dict__.get("forward")
                entry = _INSTALLED[id(layer)] = [layer, own, 0]
                layer.forward = _wrapper(layer, own if own is not None else type(layer).forward.__get__(layer))
            entry[2] += 1
    token = _SKIPPED.set(_SKIPPED.get() | {id(layer) for layer in targets})
    try:
        yield
    finally:
        _SKIPPED.reset(token)
        with _LOCK:
            for layer in targets:
                entry = _INSTALLED[id(layer)]
                entry[2] -= 1
                if entry[2] == 0:
                    del _INSTALLED[id(layer)]
                    if entry[1] is None:
                        del layer.forward
                    else:
                        layer.forward = entry[1]


@dataclass
class LayerSkip:
    """The draft's layer plan. `count`: layers to skip (CLaSp chooses which, again every `every` rounds from the
    verification's hidden states); or `fixed`: these layer indices, always."""

    count: int = 0
    fixed: tuple = ()
    every: int = 1

    @classmethod
    def parse(cls, skip_layers, n_layers: int, every: int) -> "LayerSkip | None":
        """From speculative_generate's `skip_layers` (None, an int, or layer indices); ValueError naming it."""
        if skip_layers is None:
            return None
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"reselect_every={every!r}; allowed values: an int >= 1 (rounds between CLaSp's choices)")
        if isinstance(skip_layers, int) and not isinstance(skip_layers, bool):
            if not 1 <= skip_layers < n_layers:  # (layer 0 always runs: below)
                raise ValueError(f"skip_layers={skip_layers}; allowed values: None, an int in [1, {n_layers - 1}] "
                                 f"(layers CLaSp skips), or a list of layer indices")
            return cls(count=skip_layers, every=every)
        fixed = tuple(skip_layers) if isinstance(skip_layers, (list, tuple)) else None
        if not fixed or not all(isinstance(i, int) and 1 <= i < n_layers for i in fixed) or \
                len(set(fixed)) != len(fixed):
            raise ValueError(f"skip_layers={skip_layers!r}; allowed values: None, an int in [1, {n_layers - 1}], or a "
                             f"list of distinct layer indices in [1, {n_layers - 1}] (layer 0 runs in every draft: "
                             f"the cache's length, which the forward's positions and mask follow, is read from it)")
        return cls(fixed=tuple(sorted(fixed)), every=every)

    @property
    def chooses(self) -> bool:
        return not self.fixed


def check_skippable(model, plan: LayerSkip) -> None:
    """ValueError, before anything runs, for a model whose layers kvpress cannot skip in a draft."""
    config = model.config.get_text_config(decoder=True)
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("skip_layers: this model has sliding-window layers (transformers' own cache layers), whose "
                         "rollback after a draft that skipped them is not exact yet; allowed: skip_layers=None")
    if plan.chooses and not callable(getattr(decoder_of(model), "rotary_emb", None)):
        raise ValueError(f"skip_layers={plan.count}: CLaSp's choice runs each layer over candidate states with the "
                         f"model's rotary embedding (its decoder's rotary_emb), which this model lacks; allowed: a "
                         f"list of layer indices")


class Skipper:
    """The layers a speculative call's drafts skip now, and CLaSp's choice of them (when the plan chooses)."""

    def __init__(self, model, layers: list[torch.nn.Module], plan: LayerSkip):
        self.layers, self.plan = layers, plan
        decoder = decoder_of(model)
        self.rotary = getattr(decoder, "rotary_emb", None)
        # what the model's last hidden state is reported after (Llama-style `norm`, GPT-NeoX's, Phi's)
        self.final_norm = next((getattr(decoder, name) for name in ("norm", "final_layer_norm", "final_layernorm")
                                if callable(getattr(decoder, name, None))), None)
        self.skipped = plan.fixed
        self.chosen = False  # CLaSp has chosen once (until then the drafts run every layer)

    def skipping(self):
        return skipping(self.layers, self.skipped)

    def due(self, round_number: int) -> bool:
        """Whether this round's verification makes CLaSp's choice: the first one, then every `every` rounds (the
        first round drafts with every layer)."""
        return self.plan.chooses and (not self.chosen or round_number % self.plan.every == 0)

    def choose(self, hidden: list[torch.Tensor], stats) -> None:
        start = time.perf_counter()
        self.skipped = clasp_choice(self.layers, hidden, self.plan.count, self.rotary, self.final_norm)
        self.chosen = True
        stats.select_s += time.perf_counter() - start
        stats.skipped_layers.append(self.skipped)


@torch.no_grad()
def clasp_choice(layers: list[torch.nn.Module], hidden: list[torch.Tensor], count: int, rotary,
                 final_norm=None) -> tuple:
    """CLaSp's dynamic programme: the `count` layers to skip whose draft stays closest to `hidden` (h_0 .. h_L [B, d]:
    the input of each layer, then the model's last hidden state, reported after `final_norm`, for the tokens last
    verified). `rotary`: the model's rotary embedding module (the candidates attend to themselves only, so any one
    position serves). Layer 0 always runs."""
    n = len(layers)
    best = {0: hidden[0]}  # j layers skipped so far -> the state closest to the full model's at this depth
    skipped_at = {0: ()}
    for i, layer in enumerate(layers):
        target = hidden[i + 1]
        last = i == n - 1 and final_norm is not None

        def closeness(state):  # to the full model's state after layer i, as the model reports it
            return _similarity(final_norm(state) if last else state, target)

        candidates = sorted(best)
        states = torch.stack([best[j] for j in candidates], 1)  # [B, J, d]: one "token" per candidate
        batch, width = states.shape[:2]
        alone = torch.full((width, width), torch.finfo(states.dtype).min, dtype=states.dtype, device=states.device)
        alone.fill_diagonal_(0)
        positions = torch.zeros(batch, width, dtype=torch.long, device=states.device)
        applied = layer(states, attention_mask=alone.expand(batch, 1, width, width), position_ids=positions,
                        position_embeddings=rotary(states, positions), use_cache=False)
        applied = applied[0] if isinstance(applied, tuple) else applied
        ran = {j: applied[:, k] for k, j in enumerate(candidates)}
        new, new_skipped = {}, {}
        for j in range(min(i + 1, count) + 1):
            options = []
            if j in ran and n - i - 1 >= count - j:  # run layer i (layers enough left to skip the rest)
                options.append((closeness(ran[j]), ran[j], skipped_at[j]))
            if j - 1 in best and i > 0:  # skip layer i (never layer 0: the cache's length is read from it)
                options.append((closeness(best[j - 1]), best[j - 1], skipped_at[j - 1] + (i,)))
            if options:
                _, new[j], new_skipped[j] = max(options, key=lambda option: option[0])
        best, skipped_at = new, new_skipped
    return skipped_at[count]


def _similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())
