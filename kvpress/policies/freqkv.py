"""FreqKV (Kai et al., ICLR 2026): when a layer's cache fills its capacity, the tokens between the attention sinks and
the recent window are merged in the frequency domain, along the sequence, into fewer synthetic tokens.

One round, per row (every KV head's channels at once, as the official code flattens Hkv x D):
  1. the span is the slots [n_sink, C - recent) of the oldest C (C: the capacity, the policy's budget);
  2. its keys are un-rotated to their pre-RoPE form; keys and values go through an orthonormal DCT-II along the
     sequence, per channel, and the first size = floor(ratio x span) coefficients are kept;
  3. an inverse DCT of length `size`, scaled by sqrt(size / span), gives `size` synthetic tokens (in fp32);
  4. the synthetic keys are rotated back at representative positions (below), and replace the span.
Rounds repeat while a row holds more than C tokens: at the end of the prompt (a long prompt takes several rounds,
older tokens merged again each time, as the paper's iterative mode) and whenever decoding fills the cache again.
The cache never holds more than C slots after a prompt or a decode step; the bytes are freed (the layer is
rewritten).

Positions: a synthetic token i of `size` records the position of the span's token floor((i + 1/2) span / size) (the
middle of what it summarises), so slots stay in position order. With cache_local_positions=True (the paper) attention
reads every key re-rotated to contiguous positions behind the query, as the paper applies RoPE to the cache's slot
indices; False keeps the recorded positions (not in the paper).

Differences from the official code (LUMIA-Group/FreqKV@8783a2d, `forward_iterate_*`), each named:
- No fine-tuning: the paper fine-tunes Llama-2 with LoRA (and trainable embeddings and norms) to read the merged
  tokens; here the base model reads them as they are.
- The prompt is read whole by its own forward and merged after it, where the official perplexity code merges while
  the prompt streams through in chunks of span - size tokens (kvpress's chunked prefill does that:
  prefill_chunk_size); the merged states are the same, the prompt's own hidden states are not.
- The capacity is the policy's budget (compression_ratio: a share of the prompt), not a fixed 4096.
- With recent > 0, the official queries sit `recent` positions behind their own keys (their RoPE starts after the
  merged span, their keys after the recent window); here every key sits at its cache index.
- Decoding merges again when the cache is full; the official code only evaluates perplexity over whole sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.eviction import rewrite
from ..positions import apply_rotary, unrotate
from .budget import BudgetPolicy
from .context import Context
from .protocol import Needs
from .registry import register
from .roles import Merger
from .selection import cache_local_keys


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II [n, n] (float64): row k is a_k cos(pi (2j + 1) k / 2n) over j, a_0 = sqrt(1/n),
    a_k = sqrt(2/n)."""
    j = torch.arange(n, dtype=torch.float64)
    k = j[:, None]
    scale = torch.full((n, 1), math.sqrt(2.0 / n), dtype=torch.float64)
    scale[0] = math.sqrt(1.0 / n)
    return scale * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))


def resampler(n: int, m: int) -> torch.Tensor:
    """[m, n] float64: n samples -> their first m DCT coefficients -> an inverse DCT of length m, times sqrt(m / n)
    (a band-limited sequence is resampled at m points; m = n is the identity)."""
    if m == 0:
        return torch.zeros(0, n, dtype=torch.float64)
    return math.sqrt(m / n) * dct_matrix(m).T @ dct_matrix(n)[:m]


@register
@dataclass
class FreqKV(BudgetPolicy, Merger):
    """FreqKV: sinks, a frequency-domain merge of the span behind them, a recent window; iterated whenever the cache
    reaches its capacity, the budget (module docstring)."""

    name = "freqkv"
    n_sink: int = 4
    recent: int = 0
    ratio: float = 0.5
    cache_local_positions: bool = True

    def validate(self) -> None:
        super().validate()
        for field in ("n_sink", "recent"):
            if getattr(self, field) < 0:
                raise ValueError(f"freqkv: {field}={getattr(self, field)!r}; allowed values: an int >= 0")
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"freqkv: ratio={self.ratio!r}; allowed values: a float in [0, 1) (the share of a full "
                             f"cache's span each merge keeps)")
        if self.budget is not None and self.budget <= self.n_sink + self.recent:
            raise ValueError(f"freqkv: budget={self.budget} leaves no span to merge behind n_sink + recent = "
                             f"{self.n_sink} + {self.recent}; allowed values: budget > n_sink + recent")

    def needs(self) -> Needs:
        return Needs(rotary=True)  # keys are merged in their pre-RoPE form

    def query_rows(self) -> int:
        return 0  # positions alone

    def for_model(self, model):
        if self.cache_local_positions:  # re-rotation needs standard RoPE frequencies: fail before patching
            for layer_idx in model.layers:
                try:
                    model.rotary(layer_idx).inv_freq()
                except ValueError as e:
                    raise ValueError(f"freqkv: cache_local_positions=True: {e}; allowed values for this model: "
                                     f"cache_local_positions=False") from None
        return self

    def check_codec(self, codec) -> None:
        raise ValueError(f"freqkv: merges its cache again whenever it fills, rewriting old slots that the codec "
                         f"{codec.name!r} would hold as codes; allowed: freqkv alone")

    @property
    def rewrites_keys(self) -> bool:
        return self.cache_local_positions

    def key_view(self, ctx: Context) -> torch.Tensor:
        if not self.cache_local_positions or not ctx.layer.explicit_positions:
            return ctx.keys
        return cache_local_keys(ctx.layer, ctx.keys, ctx.rotary.inv_freq())

    def appends_before_change(self, layer) -> int | None:
        if layer.row_budget is None:
            return None
        held = layer.key_valid()[:, 0].sum(-1)
        return max(0, int((layer.row_budget.to(held) - held).min()))

    # ------------------------------------------------------------------ hooks
    def on_prefill(self, ctx: Context) -> None:
        layer = ctx.layer
        n_real = ctx.prompt_tokens if ctx.prompt_tokens is not None else layer.key_valid()[:, 0].sum(-1)
        layer.row_budget = self.row_budget(n_real.to(ctx.query.device))
        layer.decode_start = layer.seen
        self.merge(ctx)

    def on_decode(self, ctx: Context) -> None:
        self.merge(ctx)

    def merge(self, ctx: Context) -> None:
        """Merge rounds in every row that holds more than its capacity; the layer is rewritten once."""
        layer = ctx.layer
        valid = layer.key_valid()
        if bool((valid != valid[:, :1]).any()):
            raise RuntimeError("freqkv: the KV heads of a row hold different slots; FreqKV keeps them together")
        held, capacity = valid[:, 0].sum(-1), layer.row_budget.to(valid.device)
        if not bool((held > capacity).any()):
            return
        keys, values, positions = layer.keys_view(), layer.values_view(), layer.key_positions()
        rows = []
        for b in range(keys.shape[0]):
            real = valid[b, 0]
            order = positions[b, 0][real].argsort()
            row = (keys[b][:, real][:, order], values[b][:, real][:, order], positions[b, 0][real][order])
            rows.append(self._rounds(*row, int(capacity[b]), ctx.rotary) if held[b] > capacity[b] else row)
        width = max(r[2].shape[0] for r in rows)
        batch, heads, _, dim = keys.shape
        new_keys, new_values = keys.new_zeros(batch, heads, width, dim), values.new_zeros(batch, heads, width,
                                                                                           values.shape[-1])
        new_positions = torch.zeros(batch, heads, width, dtype=torch.int32, device=keys.device)
        new_valid = torch.zeros(batch, heads, width, dtype=torch.bool, device=keys.device)
        for b, (k, v, p) in enumerate(rows):  # a shorter row's slots end with the others', behind leading fillers
            n = p.shape[0]
            new_keys[b, :, width - n:], new_values[b, :, width - n:] = k, v
            new_positions[b, :, width - n:], new_valid[b, :, width - n:] = p.to(torch.int32), True
        rewrite(layer, new_keys, new_values, new_positions, None if bool(new_valid.all()) else new_valid)
        # room for exactly the appends up to the next round: the buffer holds capacity + 1 slots, never a growth
        # room of 64 more
        layer.reserve(int((capacity - new_valid[:, 0].sum(-1)).max()) + 1)

    def _rounds(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, capacity: int, rotary):
        """One row's real slots (keys / values [Hkv, n, D] in position order, positions [n]) -> the same after merge
        rounds until at most `capacity` remain. Exact slots keep their stored keys; synthetic ones are rotated at
        their recorded positions."""
        cos, sin = rotary.cos_sin(positions[None].long(), keys.float())
        pre = unrotate(keys[None], cos, sin)[0]  # [Hkv, n, D] fp32
        post, values = keys, values.float()
        sinks = min(self.n_sink, capacity - 1)
        recent = min(self.recent, capacity - 1 - sinks)
        span = capacity - sinks - recent
        size = math.floor(self.ratio * span)
        merge = resampler(span, size).to(pre)
        picks = torch.floor((torch.arange(size, dtype=torch.float64) + 0.5) * span / size).long()
        while positions.shape[0] > capacity:
            end = sinks + span
            merged_pre = torch.einsum("ms,hsd->hmd", merge, pre[:, sinks:end])
            merged_values = torch.einsum("ms,hsd->hmd", merge, values[:, sinks:end])
            merged_positions = positions[sinks:end][picks.to(positions.device)]
            cos, sin = rotary.cos_sin(merged_positions[None].long(), merged_pre)
            merged_post = apply_rotary(merged_pre[None], cos, sin)[0].to(keys.dtype)
            pre = torch.cat([pre[:, :sinks], merged_pre, pre[:, end:]], 1)
            post = torch.cat([post[:, :sinks], merged_post, post[:, end:]], 1)
            values = torch.cat([values[:, :sinks], merged_values, values[:, end:]], 1)
            positions = torch.cat([positions[:sinks], merged_positions, positions[end:]])
        return post, values.to(keys.dtype), positions
