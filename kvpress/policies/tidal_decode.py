from dataclasses import dataclass

import torch

from .context import Context
from .sparse import ReadPolicy, slots_of
from .registry import register


@register
@dataclass
class TidalDecode(ReadPolicy):
    """TidalDecode (Yang et al., ICLR 2025): position-persistent sparse attention. In each decode step, layers below
    `sparse_layer_start` read everything; that layer also reads everything and picks, per KV head, the `budget` tokens
    with the highest raw logits q . k (max over the head's query heads and rows); every later layer reads just those
    token positions. `correction_layer` (None: none) reads everything again and re-selects for the layers after it.
    The selection travels between the layers of one forward (Context.shared); the step's own tokens are always read.

    Differences from the official code (DerrickYLJ/TidalDecode), each named: the selection is per KV head (the
    reference repeats KV and selects per query head; one set per group keeps the read at `budget` slots per KV head);
    layers hold the selected tokens at their own slots (found by position), so a draft over a cache that an eviction
    policy cut per layer reads what each layer still holds of them. Defaults: the function defaults
    (sparse_layer_start 2, correction_layer 9) and the LongBench script's top_k 4096."""

    name = "tidal_decode"
    budget: int = 4096
    sparse_layer_start: int = 2
    correction_layer: int | None = 9

    def validate(self) -> None:
        super().validate()
        if self.sparse_layer_start < 0:
            raise ValueError(f"tidal_decode: sparse_layer_start={self.sparse_layer_start!r}; allowed values: an int "
                             f">= 0")
        if self.correction_layer is not None and self.correction_layer <= self.sparse_layer_start:
            raise ValueError(f"tidal_decode: correction_layer={self.correction_layer!r}; allowed values: None or an "
                             f"int > sparse_layer_start={self.sparse_layer_start}")

    @property
    def _key(self) -> tuple:  # this configuration's selection in the forward's shared dict
        return ("tidal_decode", self.budget, self.sparse_layer_start, self.correction_layer)

    def select(self, ctx: Context):
        layer = ctx.layer
        real = layer.key_valid()
        picked = None if ctx.shared is None else ctx.shared.get(self._key)
        if ctx.layer_idx < self.sparse_layer_start or ctx.layer_idx in (self.sparse_layer_start,
                                                                        self.correction_layer) or picked is None:
            # a dense layer, a selection layer, or no selection made yet in this forward (a selection layer that
            # is not a kvpress layer, e.g. a sliding one): read everything, and select from here when due
            if ctx.layer_idx >= self.sparse_layer_start and ctx.shared is not None:
                ctx.shared[self._key] = self._positions(ctx, real)
            return slots_of(real)
        positions = layer.key_positions()
        if bool((positions[..., 1:] >= positions[..., :-1]).all()):  # slot order is position order (no sort)
            order, ordered = None, positions
        else:
            order = positions.argsort(dim=-1, stable=True)
            ordered = positions.gather(-1, order)
        at = torch.searchsorted(ordered.contiguous(), picked.to(ordered.dtype).contiguous())
        at = at.clamp(max=ordered.shape[-1] - 1)
        slot = at if order is None else order.gather(-1, at)
        found = (ordered.gather(-1, at) == picked) & real.gather(-1, slot)  # the layer holds that token
        width = real.shape[-1]
        chosen = torch.zeros(*real.shape[:2], width + 1, dtype=torch.bool, device=real.device)
        chosen.scatter_(-1, torch.where(found, slot, width), True)  # (tokens not held: a spare column, dropped)
        chosen = chosen[..., :width]
        chosen[..., width - ctx.q_len:] = True  # the step's own tokens
        return slots_of(chosen & real)

    def _positions(self, ctx: Context, real: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, k] positions of the top `budget` real slots by raw logits, max over each KV head's query rows."""
        logits = ctx.key_logits(ctx.query).amax(2).amax(2)  # [B, Hkv, T]
        logits = logits.masked_fill(~real, float("-inf"))
        top = logits.argsort(dim=-1, descending=True, stable=True)[..., :self.budget]
        positions = ctx.layer.key_positions().gather(-1, top)
        # a head with fewer real slots than budget: its padding picks point at fillers, never found in later layers
        return torch.where(real.gather(-1, top), positions, -1)
