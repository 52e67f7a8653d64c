"""What a policy hook sees for one attention layer in one forward (Context).

Built by the attention integration (integrations/hf.py: from a transformers attention module's call), by a serving
engine from the tensors it computes (integrations/prompts.py), or by anyone with plain tensors through
`Context.from_tensors`: no transformers module is needed, so the same scorers run wherever keys and queries are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layer import KVPressLayer
from ..heads import SINGLE, HeadShards
from ..kernels import attention_column_sums, attention_probs
from ..positions import Rotary, unrotate


@dataclass
class Context:
    """What a policy hook sees for one attention layer in one forward."""

    layer: KVPressLayer
    phase: str  # "prefill" | "decode" | "extend"
    query: torch.Tensor  # [B, Hq, q_len, D], post-RoPE
    scaling: float
    layer_idx: int  # the model's index of this attention layer
    # the transformers attention module (None where a serving engine calls the policy with plain tensors)
    module: torch.nn.Module | None = None
    softcap: float | None = None
    sliding_window: int | None = None
    # (rank of this layer, number of layers) among the layers kvpress compresses, for layer-wise budgets
    budget_layer: tuple[int, int] | None = None
    # While a chunked prefill runs: real tokens of the whole prompt per row [B], and its padded length (budgets
    # follow the prompt, not the chunk); None otherwise
    prompt_tokens: torch.Tensor | None = None
    prompt_length: int | None = None
    observers: int = 0  # this forward's last tokens are observation queries (a known question), dropped after it
    # what earlier layers of this forward left for later ones (ForwardState.shared; None: no forward around this one)
    shared: dict | None = None
    rope_positions: torch.Tensor | None = None  # [B, q_len] RoPE positions of the query rows (None: seen-based)
    # Provided only to policies that declare the need (Needs):
    rotary: Rotary | None = None  # of this layer
    hidden_states: torch.Tensor | None = None  # [B, q_len, hidden] the attention module's input
    probs: torch.Tensor | None = None  # [B, Hq, q_len, T] fp32, when the attention pass computed them
    shards: HeadShards = SINGLE  # the block of heads this process holds (all_heads; otherwise all of them)
    # A paged engine frees whole pages of this many tokens: budgets are raised until the evicted count is a multiple
    # of it (allocation.whole_pages); 1 everywhere else
    page_size: int = 1

    @classmethod
    def from_tensors(cls, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                     valid: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                     rope_positions: torch.Tensor | None = None, scaling: float | None = None, layer_idx: int = 0,
                     **fields) -> "Context":
        """The prefill Context of one layer from plain tensors, with no transformers module behind it: query
        [B, Hq, q_len, D] (post-RoPE, the prompt's last q_len rows), keys / values [B, Hkv, T, D] (the whole
        prompt, post-RoPE keys, slot j at position j), valid [B, T] (False: a padding token; default all real),
        hidden_states [B, q_len, hidden] (the attention input, for policies that need it), rope_positions
        [B, q_len] (default: the last q_len positions), scaling (default 1/sqrt(D)). `fields`: any other Context
        field (rotary, softcap, sliding_window, page_size, budget_layer, shards, ...). The keys and values go into
        a fresh KVPressLayer, which a policy's hooks (observe, on_prefill) then compress in place (ctx.layer)."""
        layer = KVPressLayer()
        layer.update(keys, values, new_valid=valid)
        return cls(layer=layer, phase="prefill", query=query,
                   scaling=query.shape[-1] ** -0.5 if scaling is None else scaling, layer_idx=layer_idx,
                   hidden_states=hidden_states, rope_positions=rope_positions, **fields)

    @property
    def keys(self) -> torch.Tensor:
        """Full-precision keys [B, Hkv, T, D] over the layer's padded view (see KVPressLayer.keys_view)."""
        return self.layer.keys_view()

    @property
    def values(self) -> torch.Tensor:
        return self.layer.values_view()

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.layer.num_kv_heads

    def query_rope_positions(self) -> torch.Tensor:
        """[B, q_len] RoPE positions of this forward's query rows."""
        if self.rope_positions is not None:
            return self.rope_positions.expand(self.query.shape[0], -1)
        return self.query_positions()[None].expand(self.query.shape[0], -1)

    def pre_rope_query(self) -> torch.Tensor:
        """fp32 [B, Hq, q_len, D]: this forward's queries before RoPE (needs rotary)."""
        positions = self.query_rope_positions()
        cos, sin = self.rotary.cos_sin(positions, self.query.new_empty(0, dtype=torch.float32))
        return unrotate(self.query, cos, sin)

    def query_positions(self, last: int | None = None) -> torch.Tensor:
        """Raw positions of the (last `last`) query rows of this forward."""
        last = self.q_len if last is None else last
        return self.layer.newest_positions(last).to(self.query.device)

    def key_logits(self, query: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """fp32 logits [B, Hkv, g, r, upto] of query rows against the stored slots (dense or quantized)."""
        return self.layer.key_logits(query, self.scaling, self.softcap, upto)

    def attention_probs(self, last: int | None = None) -> torch.Tensor:
        """Softmax attention [B, Hq, r, T] (fp32) of the last `last` query rows over the stored slots, with the
        same causal / padding / sliding-window masking the model's attention used."""
        last = self.q_len if last is None else last
        if self.probs is not None:
            return self.probs[:, :, -last:]
        return attention_probs(self.key_logits, self.query[:, :, -last:], self.query_positions(last),
                               self.layer.key_positions(), self.layer.key_valid_or_none(), self.sliding_window)

    def attention_column_sums(self, perturb=None) -> torch.Tensor:
        """Attention received by each slot, summed over all query rows of this forward: [B, Hq, T] (fp32).
        Computed in query chunks, so a long prompt never materialises its full attention matrix. `perturb`: a
        rewrite of each block of logits before the softmax (kernels.attention_column_sums)."""
        if self.probs is not None and perturb is None:  # a decode step: its one (real) query row's probabilities
            return self.probs.sum(2)
        layer = self.layer
        fp32_keys = {}  # bf16/fp16 keys go to fp32 once here, not once per query block (a prompt has hundreds)

        def key_logits(query, upto):
            return layer.key_logits(query, self.scaling, self.softcap, upto, fp32_keys=fp32_keys)

        return attention_column_sums(key_logits, self.query, self.query_positions(),
                                     layer.key_positions(), layer.key_valid_or_none(), self.sliding_window, perturb)

    def to_kv_heads(self, per_query_head: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        """[B, Hq, ...] -> [B, Hkv, ...] by reducing each GQA group (design invariant 6)."""
        batch, hq = per_query_head.shape[:2]
        grouped = per_query_head.reshape(batch, hq // self.group_size, self.group_size, *per_query_head.shape[2:])
        if reduce == "mean":
            return grouped.mean(2)
        if reduce == "sum":
            return grouped.sum(2)
        if reduce == "max":
            return grouped.amax(2)
        raise ValueError(f"reduce={reduce!r}; allowed values: 'mean', 'sum', 'max'")

