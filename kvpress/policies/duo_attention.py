"""Head split (DuoAttention, Xiao et al. 2024, arXiv 2410.10819): retrieval heads keep their whole cache,
streaming heads keep only the first `n_sink` tokens and the `window` newest ones.

Which heads stream comes from the model's calibration file (`kvpress calibrate`, kvpress/calibration.py): the
`streaming_heads` fraction of all (layer, KV head) pairs whose attention output changes least, on KVzip's context
replay over local text, when restricted to sinks + window (the paper learns a gate per head by optimisation; we
measure instead). Storage is ragged per head, so the bytes really fall: at 4K tokens, half the heads streaming
with a 256-token window hold about 53% of the full cache. While decoding, a streaming head is cut back to sinks +
window once it holds `slack` tokens more (one compaction per `slack` steps instead of one per step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..formats.calibration import Calibration
from ..heads import HeadShards
from .context import Context
from .protocol import ModelInfo
from .roles import DecodeEviction
from .selection import first_slots, last_slots, select_kept
from .registry import register


@register
@dataclass
class DuoAttention(DecodeEviction):
    name = "duo_attention"
    streaming_heads: float = 0.5
    n_sink: int = 4
    window: int = 256
    slack: int = 64
    calibration: str | None = None
    # {layer_idx: [Hkv] bool} streaming heads, resolved from the calibration file when patching
    heads: object = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        if not 0.0 <= self.streaming_heads <= 1.0:
            raise ValueError(f"duo_attention: streaming_heads={self.streaming_heads!r}; allowed values: a fraction "
                             f"in [0, 1] of the model's (layer, KV head) pairs")
        for name in ("n_sink", "slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"duo_attention: {name}={getattr(self, name)!r}; allowed values: an int >= 0")
        if self.window < 1:
            raise ValueError(f"duo_attention: window={self.window!r}; allowed values: an int >= 1")

    @property
    def capture_refusal(self) -> str | None:
        if 0 < self.streaming_heads < 1:
            return ("keeps fewer tokens in its streaming heads than in the others (flat runs), whose reads take their "
                    "sizes from the data")
        return super().capture_refusal

    def for_model(self, model: ModelInfo) -> "DuoAttention":
        if self.heads is not None:
            return self
        calibration = Calibration.for_model(model, self.calibration)
        return dataclasses.replace(self, heads=calibration.streaming_heads(self.streaming_heads))

    def on_prefill(self, ctx: Context) -> None:
        self._cut_streaming_heads(ctx, 0)

    def on_decode(self, ctx: Context) -> None:
        self._cut_streaming_heads(ctx, self.slack)

    def _cut_streaming_heads(self, ctx: Context, slack: int) -> None:
        layer = ctx.layer
        streaming = HeadShards.block_of(self.heads[ctx.layer_idx], layer.num_kv_heads).to(ctx.query.device)
        if not bool(streaming.any()):
            return
        valid = layer.key_valid()
        n_valid = valid.sum(-1)
        # each (row, streaming head) is cut on its own schedule, when it passes its own limit: a padded row in a
        # batch keeps what it keeps alone, whenever the other rows are cut
        over = streaming[None] & (n_valid > self.n_sink + self.window + slack)  # [B, Hkv]
        if not bool(over.any()):
            return
        ones = torch.ones_like(n_valid)
        kept = valid & (~over[..., None] | first_slots(layer, ones * self.n_sink) | last_slots(layer, ones * self.window))
        layer.keep(*select_kept(kept.float(), valid, kept.sum(-1)))
