from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..cache.held import DerivedState
from ..formats.calibration import Calibration
from ..formats.lowbit import pack, quantize
from ..kernels.labels import Labels, label_scores
from ..kernels.slots import top_slots
from ..heads import HeadShards
from .context import Context
from .protocol import ModelInfo
from .sparse import ReadPolicy, slots_of
from .registry import register


LABEL_CHANNELS = 16  # the paper's r (Llama's 128-channel heads at group_factor 8)


@register
@dataclass
class DoubleSparsity(ReadPolicy):
    """Double Sparsity (Yang et al. 2024): each decode step reads, per KV head, the `budget` slots with the highest
    approximate score over r = head_dim / group_factor "label" channels of each query head, s_j = q[C_h] . k_j[C_h] /
    sqrt(r) (max over the KV head's query heads and rows), plus the step's own tokens; layers below `dense_layers`
    read everything. C_h comes from the model's calibration file ('qk' mode: kvpress/channels.py; `kvpress calibrate`
    makes it, `--channels-only` adds it to an existing file). The label cache holds every stored key's r channels
    per query head, min-max quantized per token to `label_bits` (packed, with an fp16 scale and min; 16: fp16
    values), as is the query's side; it grows as tokens arrive and is read instead of the keys.
    Defaults, the best measured (docs/results/double_sparsity, SmolLM2 at a 10% read): the paper's 16 label channels
    (group_factor None: head_dim / 16; 58.1 against the full cache's 59.0, where 8 channels scored 52.3) and no dense
    layers (dense_layers=2 read 16% for 55.2 against 57.5).

    Differences from the official code (andy-yang-1/DoubleSparse), each named: the top-k is per KV head over its
    query heads (the reference repeats KV and picks per query head; one set per group keeps the read at `budget`
    slots per KV head); label_bits reaches every layer (the reference's converter does not forward it: its layers
    stay at 4 bits); decode and verification steps only (its perplexity path selects per prompt row)."""

    name = "double_sparsity"
    allowed_label_bits: ClassVar[tuple] = (2, 4, 8, 16)
    budget: int = 256
    group_factor: int | None = None  # None: head_dim / LABEL_CHANNELS (the paper's 16 channels)
    label_bits: int = 4
    dense_layers: int = 0
    calibration: str | None = None
    # {layer_idx: [Hq, r] channels}, resolved from the calibration file when patching
    channels: object = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.group_factor is not None and self.group_factor < 1:
            raise ValueError(f"double_sparsity: group_factor={self.group_factor!r}; allowed values: None (16 label "
                             f"channels) or an int >= 1 (r = head_dim / group_factor label channels)")
        if self.label_bits not in self.allowed_label_bits:
            raise ValueError(f"double_sparsity: label_bits={self.label_bits!r}; allowed values: "
                             f"{list(self.allowed_label_bits)}")
        if self.dense_layers < 0:
            raise ValueError(f"double_sparsity: dense_layers={self.dense_layers!r}; allowed values: an int >= 0")

    def for_model(self, model: ModelInfo) -> "DoubleSparsity":
        if self.channels is not None:
            return self
        r = min(LABEL_CHANNELS, model.head_dim) if self.group_factor is None else model.head_dim // self.group_factor
        if r < 1:
            raise ValueError(f"double_sparsity: group_factor={self.group_factor} leaves no channel of the model's "
                             f"head_dim={model.head_dim}; allowed values: 1 <= group_factor <= {model.head_dim}")
        calibration = Calibration.for_model(model, self.calibration)
        if calibration.channels is None:
            raise ValueError(f"double_sparsity: calibration={self.calibration!r} has no label channels; allowed: a "
                             f"file with them (`kvpress calibrate --model <model folder> --channels-only` adds them)")
        return dataclasses.replace(self, channels={layer: calibration.label_channels(layer, r)
                                                   for layer in calibration.layers})

    def select(self, ctx: Context):
        layer = ctx.layer
        real = layer.key_valid()
        if ctx.layer_idx < self.dense_layers:
            return slots_of(real)
        channels = self._channels(ctx)  # [Hq, r]
        labels = label_cache(layer, ("double_sparsity", self.group_factor, self.label_bits, self.calibration),
                             channels, self.label_bits)
        q = ctx.query.float().gather(-1, channels[None, :, None].expand(ctx.query.shape[0], -1, ctx.q_len, -1))
        width = layer.view_width
        # max over the group's heads and rows
        scores = label_scores(quantized(q, self.label_bits), labels, self.label_bits, width, layer.num_kv_heads)
        return top_slots(scores, real, self.budget, width - ctx.q_len)  # and the step's own tokens

    def _channels(self, ctx: Context) -> torch.Tensor:
        channels = self.channels[ctx.layer_idx]
        hq = ctx.query.shape[1]
        return HeadShards.of(hq, channels.shape[0]).local(channels, 0).to(ctx.query.device)


def quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x min-max quantized per row of its last dim to `bits` and read back (16: x itself)."""
    if bits >= 16:
        return x
    codes, scale, low = quantize(x, bits, dim=-1)
    return codes.float() * scale.float()[..., None] + low.float()[..., None]


def label_cache(layer, key: tuple, channels: torch.Tensor, bits: int) -> Labels:
    """Every stored key's label channels per query head, as stored (kernels/labels.py's Labels, with room for more
    slots: layer.derived[key] holds them, extended as tokens arrive)."""
    cache = layer.derived.get(key)
    if cache is None:
        cache = layer.derived[key] = _Labels(channels, bits)
    return cache.update(layer)


class _Labels(DerivedState):
    """The label cache of one layer: the labels of its first `complete` slots, packed `bits`-bit codes with an fp16
    scale and min per (slot, query head) (16 bits: fp16 values), in buffers with room for more slots (grown by a
    quarter when full, so a decode step's labels are written in place, not appended by a copy of all the others);
    the slots after them are encoded on the next read. The channels are the calibration's (the model's)."""

    shared = ("channels",)

    def __init__(self, channels: torch.Tensor, bits: int):
        self.channels, self.bits, self.complete, self.buffers = channels, bits, 0, None

    def truncate(self, n_slots: int) -> None:
        self.complete = min(self.complete, n_slots)

    def update(self, layer) -> Labels:
        width = layer.view_width
        if self.complete < width:
            keys = layer.keys_view()[:, :, self.complete:].float()  # [B, Hkv, n, D]
            batch, hkv, n, _ = keys.shape
            hq, r = self.channels.shape
            per_head = keys.repeat_interleave(hq // hkv, 1)  # each query head's KV head
            labels = per_head.gather(-1, self.channels[None, :, None].expand(batch, -1, n, -1))
            if self.bits >= 16:
                new = (labels.half(), None, None)
            else:
                codes, scale, low = quantize(labels, self.bits, dim=-1)
                new = (pack(codes, self.bits), scale, low)
            self._write(new, width)
        return self.buffers

    def _write(self, new: tuple, width: int) -> None:
        """new labels for slots complete..width, into the buffers (grown first if they lack the room)."""
        if self.buffers is None or self.buffers[0].shape[2] < width:
            room = width + width // 4
            grown = tuple(None if t is None else t.new_empty(*t.shape[:2], room, *t.shape[3:]) for t in new)
            if self.buffers is not None:
                for old, buffer in zip(self.buffers, grown):
                    if old is not None:
                        buffer[:, :, :self.complete] = old[:, :, :self.complete]
            self.buffers = grown
        for part, buffer in zip(new, self.buffers):
            if part is not None:
                buffer[:, :, self.complete:width] = part
        self.complete = width
