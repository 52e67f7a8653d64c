"""What a serving engine calls while a request decodes: decode-time eviction from plain tensors, a cut at a time.

A paged engine cannot free one token a step; it frees a page. A policy that evicts while decoding with `slack`
(`cut = slack + 1` tokens per cut, a multiple of the page: Policy.paged_decode_cuts) holds up to `held + cut - 1`
tokens per KV head, and the step whose token would make it `held + cut` cuts it back to `held`: the transformers
path's own schedule (ScorerPolicy.on_decode). At such a step the engine reads the tokens its pages hold for one
layer, this object runs the policy's own `on_decode` on a KVPressLayer holding them, and the engine writes the kept
tokens back, every KV head's in position order, behind the pages it then frees.

The engine's attention needs no positions (keys are stored after RoPE); the policy does (sinks, recency, which
tokens are generated), so this object keeps, per layer, the original positions of the tokens held at the last
cut (or the prompt's end); tokens computed since then sit behind them in order. Policies whose decode-time cut
reads something observed at every step (H2O's accumulated attention) are refused by Policy.engine_refusal: the
engine does not run the steps between cuts through the policy.
"""

from __future__ import annotations

import torch

from ..cache import KVPressLayer
from ..policies import Context, Policy
from ..policies.allocation import whole_pages
from .prompts import Kept, LayerFacts


class DecodeCuts:
    """One request's decode-time eviction in an engine's pages (one object per request, from its prompt's end)."""

    def __init__(self, policy: Policy, prompt_length: int, page_size: int):
        self.policy = policy
        self.prompt_length = prompt_length
        n = torch.tensor([prompt_length])
        self._row_budget = int(whole_pages(policy.row_budget(n), n, page_size))  # the prompt's cut fixed it
        self._positions: dict[int, torch.Tensor] = {}  # layer -> [Hkv, m] positions held after the last cut
        self._since: dict[int, int] = {}  # layer -> tokens seen then (those computed since sit behind, in order)

    def started(self, layer_idx: int, positions: torch.Tensor) -> None:
        """The prompt's cut kept `positions` [Hkv, m] in this layer (a prompt that kept every token needs no call:
        its tokens sit at their own positions)."""
        self._positions[layer_idx] = positions
        self._since[layer_idx] = self.prompt_length

    def cut(self, facts: LayerFacts, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int,
            holds: int) -> Kept:
        """One layer's cut at the step that has seen `seen` tokens: query [q, Hq, D] (post-RoPE, this step's rows),
        keys / values [n, Hkv, D] the tokens the layer's pages hold (this step's included), in slot order. Returns
        the `holds` tokens per KV head that stay, in position order."""
        heads = keys.shape[1]
        held = self._positions.get(facts.layer_idx)
        since = self._since.get(facts.layer_idx, 0)
        new = torch.arange(since, seen, dtype=torch.int32, device=keys.device).expand(heads, -1)
        positions = new if held is None else torch.cat([held.to(new), new], 1)
        if positions.shape[1] != keys.shape[0]:
            raise RuntimeError(f"kvpress: layer {facts.layer_idx}'s pages hold {keys.shape[0]} tokens, its decode "
                               f"state {positions.shape[1]}")
        layer = KVPressLayer.holding(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], positions[None],
                                     seen=seen, new_tokens=query.shape[0], row_budget=self._row_budget,
                                     decode_start=self.prompt_length)
        ctx = Context(layer=layer, phase="decode", query=query.transpose(0, 1)[None], scaling=facts.scaling,
                      layer_idx=facts.layer_idx, softcap=facts.softcap, rotary=facts.rotary)
        self.policy.on_decode(ctx)
        if not layer.sorted:
            layer.sort()
        if layer.is_flat or layer.view_width != holds or not bool(layer.key_valid().all()):
            raise RuntimeError(f"kvpress: layer {facts.layer_idx} kept {layer.tokens_per_head()[0].tolist()} tokens "
                               f"per head at a decode-time cut, the engine frees pages for {holds} per head")
        kept = layer.key_positions()[0]
        self._positions[facts.layer_idx], self._since[facts.layer_idx] = kept, seen
        return Kept(layer.keys_view()[0].transpose(0, 1), layer.values_view()[0].transpose(0, 1), kept)
