"""What a serving engine calls while a request decodes: decode-time eviction from plain tensors, a cut at a time.

A paged engine cannot free one token a step; it frees a page. A policy that evicts while decoding with `slack`
(`cut = slack + 1` tokens per cut, a multiple of the page: Policy.paged_decode_cuts) holds up to `held + cut - 1`
tokens per KV head, and the step whose token would make it `held + cut` cuts it back to `held`: the transformers
path's own schedule (ScorerPolicy.on_decode). At such a step the engine reads the tokens its pages hold for one
layer, this object runs the policy's own hooks on a KVPressLayer holding them (cache.rows.holding), and the engine
writes the kept tokens back, every KV head's in position order, behind the pages it then frees.

The engine's attention needs no positions (keys are stored after RoPE); the policy does (sinks, recency, which
tokens are generated), so this object keeps, per layer, the original positions of the tokens held at the last cut
(or the prompt's end); tokens computed since then sit behind them in order. A policy that observes every decode
step (Policy.observes_decode: H2O's accumulated attention) is handed every step, not only the cuts: the engine reads
the pages at each of its steps, and this object carries its per-slot state and per-layer statistics between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVPressLayer
from ..cache.rows import holding
from ..policies import Context, Policy
from .prompts import Kept, LayerFacts


@dataclass(frozen=True)
class Held:
    """What a layer's pages hold besides keys and values, as the policy sees it: each slot's original position
    [Hkv, n], per-slot state {name: [Hkv, n]}, per-layer statistics {name: [1, ...]}. (The keys and values stay in the
    engine's pages alone: nothing of them is kept here between steps.)"""

    positions: torch.Tensor
    state: dict
    stats: dict

    @classmethod
    def of(cls, kept: Kept) -> "Held":
        return cls(kept.positions, kept.state, kept.stats)


class DecodeCuts:
    """One request's decode-time eviction in an engine's pages (one object per request, from its prompt's end)."""

    def __init__(self, policy: Policy, prompt_length: int, page_size: int):
        self.policy = policy
        self.prompt_length = prompt_length
        self.every_step = policy.observes_decode  # else only the steps that cut
        self._row_budget = policy.paged_budget(prompt_length, page_size)  # the prompt's cut fixed it
        self._held: dict[int, Held] = {}  # layer -> what it held after the last step handed here
        self._since: dict[int, int] = {}  # layer -> tokens seen then (those computed since sit behind, in order)

    def started(self, layer_idx: int, kept: Kept) -> None:
        """The prompt's cut kept `kept` in this layer (a prompt that kept every token needs no call: its tokens sit
        at their own positions, with no state yet)."""
        self._held[layer_idx] = Held.of(kept)
        self._since[layer_idx] = self.prompt_length

    def step(self, facts: LayerFacts, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             hidden_states: torch.Tensor | None, seen: int, holds: int | None) -> Kept | None:
        """One layer at a step that has seen `seen` tokens: query [q, Hq, D] (post-RoPE, this step's rows), keys /
        values [n, Hkv, D] the tokens the layer's pages hold (this step's included) in slot order, hidden states
        [q, hidden] (for policies that need them). `holds`: the tokens per KV head that stay at this step's cut,
        which this returns (in position order); None: no cut, the policy observes the step."""
        layer = self._layer(facts.layer_idx, keys, values, seen, query.shape[0])
        ctx = Context(layer=layer, phase="decode", query=query.transpose(0, 1)[None], scaling=facts.scaling,
                      layer_idx=facts.layer_idx, softcap=facts.softcap, rotary=facts.rotary,
                      hidden_states=None if hidden_states is None else hidden_states[None])
        if self.every_step:
            self.policy.observe(ctx)
        if holds is not None:
            self.policy.on_decode(ctx)
            if not layer.sorted:
                layer.sort()
            if layer.is_flat or layer.view_width != holds or not bool(layer.key_valid().all()):
                raise RuntimeError(f"kvpress: layer {facts.layer_idx} kept {layer.tokens_per_head()[0].tolist()} "
                                   f"tokens per head at a decode-time cut, the engine frees pages for {holds} per "
                                   f"head")
        kept = Kept.of(layer)
        self._held[facts.layer_idx], self._since[facts.layer_idx] = Held.of(kept), seen
        return kept if holds is not None else None

    def _layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, seen: int, q: int) -> KVPressLayer:
        """A layer holding the tokens read back: positions and state as the last step left them, the tokens computed
        since behind them (their state zero, as an append's)."""
        heads = keys.shape[1]
        held = self._held.get(layer_idx)
        since = self._since.get(layer_idx, 0)
        new = torch.arange(since, seen, dtype=torch.int32, device=keys.device).expand(heads, -1)
        positions = new if held is None else torch.cat([held.positions.to(new), new], 1)
        if positions.shape[1] != keys.shape[0]:
            raise RuntimeError(f"kvpress: layer {layer_idx}'s pages hold {keys.shape[0]} tokens, its decode state "
                               f"{positions.shape[1]}")
        state = {} if held is None else {
            name: torch.nn.functional.pad(s, (0, seen - since))[None] for name, s in held.state.items()}
        return holding(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], positions[None], seen=seen,
                       new_tokens=q, row_budget=self._row_budget, decode_start=self.prompt_length, state=state,
                       stats=None if held is None else held.stats)
