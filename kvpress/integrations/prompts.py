"""What a serving engine calls: one request's prompt compressed from plain tensors, chunk by chunk.

A serving engine computes attention itself, over its own paged cache; kvpress decides which prompt tokens stay.
Per attention layer the engine hands over each prompt chunk's post-RoPE queries, keys and values (and the
attention input's hidden states when the policy declares that need), then, after the prompt's last chunk, asks
which tokens each KV head keeps. The decision is the transformers path's own: a KVPressLayer holds the prompt, a
Context is built from the tensors, and the policy's own `observe` and `on_prefill` run on them. Chunks give the
one-shot result: the layer holds every chunk, `observe` sees every chunk's query rows as they pass, and
`on_prefill` runs once, after the last chunk, with the last query rows the policy reads (Policy.query_rows).

An engine frees whole pages, so budgets are raised until the evicted count fills whole pages
(allocation.whole_pages, through Context.page_size): `evicted_tokens` is that count, the same number on the
engine's scheduler (which frees the pages) and in its workers (which move the kept tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..cache import KVPressLayer
from ..policies import Context, Policy
from ..policies.registry import get_policy_class, list_policies
from ..positions import Rotary


def check_servable(policy: Policy) -> None:
    """Raise ValueError unless `policy` decides from one prompt's tensors, layer by layer, at the prompt's end: what
    an engine that frees whole pages after the prompt can run (each policy says why not: Policy.engine_refusal)."""
    refusal = policy.engine_refusal
    if refusal is not None:
        served = ", ".join(servable_policies())
        raise ValueError(f"policy={policy.describe()!r} {refusal} (served: {served})")


def servable_policies() -> list[str]:
    """The registered policies an engine serves with their defaults and its own (Policy.served_defaults)."""
    out = []
    for name in list_policies():
        cls = get_policy_class(name)
        try:
            policy = cls(**({"compression_ratio": 0.5} if cls.needs_budget else {}), **cls.served_defaults)
        except ValueError:  # (a policy that needs a setting of its own to be made at all)
            continue
        if policy.engine_refusal is None:
            out.append(name)
    return out


def evicted_tokens(policy: Policy, prompt_length: int, page_size: int) -> int:
    """Prompt tokens a request evicts from every layer and KV head (a multiple of `page_size`): its budget, raised
    to whole pages. An engine's scheduler frees this many leading tokens' pages once the prompt is computed."""
    if not policy.needs_budget:
        return 0
    return prompt_length - min(policy.paged_budget(prompt_length, page_size), prompt_length)


@dataclass(frozen=True)
class LayerFacts:
    """What a layer's attention gives besides its tensors (the same for every request)."""

    layer_idx: int
    scaling: float
    softcap: float | None = None
    rotary: Rotary | None = None  # for policies that declare the need


@dataclass(frozen=True)
class Kept:
    """The tokens one layer keeps of a prompt, in position order: keys and values [n, Hkv, D], positions [Hkv, n];
    and what the policy carries on into decoding: its per-slot state {name: [Hkv, n]} (H2O's accumulated attention)
    and its per-layer statistics {name: [1, ...]} (KVPressLayer.policy_stats)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    state: dict = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, layer: KVPressLayer) -> "Kept":
        """What a one-row layer of one rectangle (one budget for every head) holds."""
        return cls(layer.keys_view()[0].transpose(0, 1), layer.values_view()[0].transpose(0, 1),
                   layer.key_positions()[0], {name: layer.get_state(name)[0] for name in layer.tail.state},
                   dict(layer.policy_stats))


class PromptCompression:
    """One request's prompt, compressed by `policy` as an engine computes it (one object per request)."""

    def __init__(self, policy: Policy, page_size: int = 1):
        self.policy = policy
        self.page_size = page_size
        self._layers: dict[int, KVPressLayer] = {}
        self._queries: dict[int, torch.Tensor] = {}  # per layer, the last query rows on_prefill will read
        self._rows = max(1, policy.query_rows())

    def add(self, facts: LayerFacts, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            hidden_states: torch.Tensor | None = None) -> None:
        """One chunk of the prompt in one layer: query [n, Hq, D] (post-RoPE), key / value [n, Hkv, D], hidden
        states [n, hidden] (the attention input, for policies that need it)."""
        layer = self._layers.setdefault(facts.layer_idx, KVPressLayer())
        layer.update(key.transpose(0, 1)[None], value.transpose(0, 1)[None])
        query = query.transpose(0, 1)[None]  # [1, Hq, n, D]
        hidden = None if hidden_states is None else hidden_states[None]
        self.policy.observe(self._context(facts, layer, query, hidden))
        earlier = self._queries.get(facts.layer_idx)
        rows = query if earlier is None else torch.cat([earlier, query], 2)
        self._queries[facts.layer_idx] = rows[:, :, -self._rows:]

    def finish(self, facts: LayerFacts) -> Kept:
        """The prompt is complete in this layer: evict, and return what stays (the layer is dropped here)."""
        layer = self._layers.pop(facts.layer_idx)
        self.policy.on_prefill(self._context(facts, layer, self._queries.pop(facts.layer_idx), None))
        return Kept.of(layer)  # one rectangle: one budget

    def _context(self, facts: LayerFacts, layer: KVPressLayer, query: torch.Tensor, hidden) -> Context:
        return Context(layer=layer, phase="prefill", query=query, scaling=facts.scaling, layer_idx=facts.layer_idx,
                       softcap=facts.softcap, rotary=facts.rotary, hidden_states=hidden, page_size=self.page_size)
