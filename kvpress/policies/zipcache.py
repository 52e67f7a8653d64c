"""ZipCache (He et al. 2024, arXiv 2405.14256; ThisisBillhe/ZipCache): salient tokens at more bits, the rest at fewer.

Saliency is attention normalised by how many queries could see the token (a plain attention sum favours early
tokens, which every later query sees). At the prompt it is estimated from probe queries, the last `recent_ratio` of
the prompt plus `random_ratio` of it drawn at random from the earlier positions (with replacement), so the full
attention matrix is never built:

    s_j = sum over probes p, and the query heads of the KV group, of softmax(q_p K^T / sqrt(d))_j
    saliency_j = s_j / n_j,   n_j = the number of probes at positions >= j (those that can see token j)

Each flushed block is split per KV head: the `low_ratio` least salient tokens go to a `low_bits` code segment, the
others to a `high_bits` one (cache/flush.py: one segment per width). Decode-time blocks are scored by the
attention of the query that triggers the flush (unnormalised, as the reference scores its streaming blocks).

Differences from the reference, named:
- Storage is KIVI's layout per width (kvpress/formats/lowbit.py): keys per channel over groups of `group_size`
  slots of the same width, values per token over `group_size` channels of one head. The reference takes key
  ranges over every token of a width at once, and value ranges over all KV heads' channels after dividing each
  channel by c_i = sqrt(max_t |V[t, i]|) (its "channel-separable" value quantizer). That normalisation is not
  implemented: the kernels read one (scale, min) per token group and have no per-channel factor to apply. On
  SmolLM2's values it would lower the 2-bit relative error from 0.516 to 0.449, 4-bit from 0.103 to 0.089
  (benchmarks/value_channel_scales.py): 2-bit values would still be off by 45%.
- Each width's share of a block is rounded to whole groups of `group_size` slots per head, so codes stay in
  whole key groups (a block of one group goes to one width: the lower one only if low_ratio >= 0.5).
- Decode: tokens are flushed a group at a time once `residual_length + group_size` are in full precision (the
  reference re-quantizes the whole cache every 100 steps; here only the new block is quantized, never twice).
- The probes of a left-padded row are drawn from its own tokens (the same draws as alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.codecs import encode_kivi
from ..cache.rollback import appends_before_flush
from ..kernels.scores import attention_probs
from .context import Context
from .kivi import check_layout
from .roles import Codec
from .sparse import slots_of
from .registry import register

_SALIENCY = "zipcache saliency"  # layer.policy_stats: the prompt's saliency by position, from observe to the flush


@register
@dataclass
class ZipCache(Codec):
    """Mixed-precision storage: per KV head, the `low_ratio` least salient tokens of each flushed block at
    `low_bits`, the rest at `high_bits`. Composes after an eviction policy ("kvzap+zipcache"); the prompt's
    saliency is measured before the eviction, over the whole prompt."""

    name = "zipcache"
    allowed_bits: ClassVar[tuple] = (2, 4, 8)
    high_bits: int = 4
    low_bits: int = 2
    low_ratio: float = 0.4
    group_size: int = 64
    residual_length: int = 0
    recent_ratio: float = 0.05
    random_ratio: float = 0.05
    seed: int = 0

    def validate(self) -> None:  # (kinds come from the annotations: params.py)
        for field in ("high_bits", "low_bits"):
            if getattr(self, field) not in self.allowed_bits:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}; allowed values: "
                                 f"{list(self.allowed_bits)}")
        if self.low_bits > self.high_bits:
            raise ValueError(f"{self.name}: low_bits={self.low_bits} > high_bits={self.high_bits}; allowed values: "
                             f"low_bits <= high_bits")
        for field in ("low_ratio", "recent_ratio", "random_ratio"):
            if not 0 <= getattr(self, field) <= 1:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}; allowed values: a number in [0, 1]")
        if self.recent_ratio <= 0:
            raise ValueError(f"{self.name}: recent_ratio={self.recent_ratio!r}; allowed values: a number in (0, 1] "
                             f"(the last query is always a probe)")
        for field, low in (("group_size", 1), ("residual_length", 0), ("seed", 0)):
            if getattr(self, field) < low:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}; allowed values: an int >= {low}")

    def for_model(self, model):
        check_layout(self.name, model.head_dim, self.group_size, self.low_bits)  # (low_bits: the stricter fill)
        return self

    def appends_before_change(self, layer) -> int:
        return appends_before_flush(layer, self.residual_length, self.group_size)

    # -- hooks
    def observe(self, ctx: Context) -> None:
        # the prompt's saliency is measured before any eviction (an evictor composed with this codec may decide
        # only after the whole prompt, when the queries are gone) and kept by position until the flush
        if ctx.phase == "prefill":
            ctx.layer.policy_stats[_SALIENCY] = _by_position(ctx.layer, self.probe_saliency(ctx))

    def on_prefill(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)

    def store(self, layer, layer_idx: int) -> None:
        """Flush what the residual window no longer covers, split by the prompt's saliency (dropped after it)."""
        if _SALIENCY not in layer.policy_stats:
            raise RuntimeError(f"{self.name}: store() before the prompt's saliency was observed")
        self._flush(layer, layer.policy_stats.pop(_SALIENCY))

    def on_decode(self, ctx: Context) -> None:
        if self.appends_before_change(ctx.layer) < 0:  # this step's flush moves a block: score it first
            self._flush(ctx.layer, _by_position(ctx.layer, self.query_saliency(ctx)))

    def on_extend(self, ctx: Context) -> None:
        self.on_decode(ctx)

    # -- saliency over the layer's padded view [B, Hkv, T]
    def probes(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """(query rows [B, P], weight [B, P]) of each row's probes: its last ceil(recent_ratio * n) tokens and
        ceil(random_ratio * n) draws (with replacement) from its earlier ones, n its real tokens in this forward;
        weight counts a draw (0: a filler entry of a row with fewer probes)."""
        q_len = ctx.q_len
        padding = ctx.layer.padding
        positions = ctx.query_positions().to(ctx.query.device)  # [q_len] raw
        pad = torch.zeros(ctx.query.shape[0], dtype=torch.long, device=positions.device) if padding is None \
            else padding.to(positions.device).long()
        n = (positions[None] >= pad[:, None]).sum(-1)  # [B] real query rows
        recent = torch.ceil(n * self.recent_ratio).long().clamp(max=n)
        drawn = torch.where(n > recent, torch.ceil(n * self.random_ratio).long(), 0)
        width = int((recent + drawn).max())
        # one stream of draws per layer: a row's first draws are the same whatever the batch's widest row needs
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * ctx.layer_idx)
        uniform = torch.rand(width, generator=gen, dtype=torch.float64).to(positions.device)
        slot = torch.arange(width, device=positions.device)[None]
        first = q_len - n[:, None]  # [B, 1] the row's first real query row
        drawn_rows = first + torch.floor(uniform[None] * (n - recent)[:, None]).long()  # before the recent ones
        rows = torch.where(slot < recent[:, None], q_len - recent[:, None] + slot, drawn_rows)
        weight = (slot < (recent + drawn)[:, None]).float()
        return rows.clamp(0, q_len - 1), weight

    def probe_saliency(self, ctx: Context) -> torch.Tensor:
        layer = ctx.layer
        rows, weight = self.probes(ctx)
        batch, hq, _, dim = ctx.query.shape
        query = ctx.query.gather(2, rows[:, None, :, None].expand(batch, hq, rows.shape[1], dim))
        query_pos = ctx.query_positions().to(rows.device)[rows]  # [B, P] raw positions, each row its own
        key_pos = layer.key_positions().to(rows.device)
        probs = attention_probs(ctx.key_logits, query, query_pos, key_pos, layer.key_valid_or_none(),
                                ctx.sliding_window)  # [B, Hq, P, T]
        mass = ctx.to_kv_heads((probs * weight[:, None, :, None]).sum(2), reduce="sum")  # over probes, group heads
        seen = key_pos[:, :, None, :] <= query_pos[:, None, :, None]  # [B, Hkv, P, T]
        viewers = (seen.float() * weight[:, None, :, None]).sum(2)  # probes that can see each slot
        return mass / viewers.clamp(min=1)

    def query_saliency(self, ctx: Context) -> torch.Tensor:
        """Attention of this step's query rows, summed over them and the group's heads (unnormalised)."""
        return ctx.to_kv_heads(ctx.attention_probs().sum(2), reduce="sum")

    # -- the flush
    def _flush(self, layer, by_position: torch.Tensor) -> None:
        def partition(keys, values, real, moved_positions):
            return self.shares(by_position.gather(-1, moved_positions.long()), real)

        encoders = [lambda k, v, ok, at, b=bits: encode_kivi(k, v, ok, b, self.group_size)
                    for bits in (self.high_bits, self.low_bits)]
        layer.flush_low_bit(self.residual_length, self.group_size, encoders, partition)

    def shares(self, saliency: torch.Tensor, real: torch.Tensor):
        """[(take, real) of the high-bit share, (take, real) of the low-bit share] of a block [B, Hkv, n]: per
        head the round(low_ratio * count / group_size) * group_size least salient real slots go low."""
        g = self.group_size
        count = real.sum(-1)
        n_low = torch.floor(self.low_ratio * count / g + 0.5).long() * g
        order = saliency.masked_fill(~real, math.inf).argsort(dim=-1, stable=True)  # least salient first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                .expand_as(order))
        low = real & (rank < n_low[..., None])
        return [slots_of(real & ~low), slots_of(low)]  # each share in slot order


def _by_position(layer, saliency: torch.Tensor) -> torch.Tensor:
    """Saliency over the padded view [B, Hkv, T] as [B, Hkv, seen + 1] indexed by position (the flush sees each
    moved slot's position, not its view slot; a head holds a position at most once; fillers land in the last
    column)."""
    batch, heads, _ = saliency.shape
    out = saliency.new_zeros(batch, heads, layer.seen + 1)
    return out.scatter_(-1, torch.where(layer.key_valid(), layer.key_positions().long(), layer.seen), saliency)
