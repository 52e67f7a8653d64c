"""SubGen's storage (Zandieh et al. 2024): a layer's prompt as a sketch that estimates attention instead of keeping
every token. Attention of a query q over tokens j is N / Z with N = sum_j e^(q.k_j) v_j and Z = sum_j e^(q.k_j):
  Z  is estimated from key clusters: each cluster's uniform sample of keys, weighted count / sample size;
  N  is estimated from an l2 sample of (key, value) pairs, drawn with probability |v_j|^2 / sum |v|^2 with
     replacement: a drawn token weighs (times drawn) x sum |v|^2 / (draws x |v_j|^2);
  exact tokens (the sinks and the recent window) count once in both, weight 1.
So each stored slot is a real token with two weights, `den_weight` (its share of Z) and `num_weight` (of N); a slot
with a zero numerator weight needs no value, and those slots come last, past the `values` the segment holds:

  keys        [B, Hkv, W, D]  every slot's key (post-RoPE, as stored)
  values      [B, Hkv, V, D]  the values of slots 0..V-1 (exact and numerator slots), V <= W
  num_weight  [B, Hkv, V]     fp32
  den_weight  [B, Hkv, W]     fp32 (0: a numerator sample that is no cluster's sample)
Its segment holds each slot's original position and validity (heads and rows keep different counts; the rest are
invalid fillers). A read folds sum_j den_weight_j e^(s_j) into the online softmax's running sum and sum_j num_weight_j
e^(s_j) v_j into its accumulator, where a plain slot adds the same e^(s_j) to both: the state merges with the tail's
(generated tokens) as any other. The sketch is never gathered, concatenated or flattened: the policy composes with
nothing (as ShadowKV's tiers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from .payloads import FullPrecision
from .segments import Segment

SKETCH = "sketch"


@dataclass
class Sketch:
    """One layer's prompt as SubGen's weighted samples (module docstring). Follows `Payload` (payloads.py)."""

    low_bit: ClassVar[bool] = False
    storage_kind: ClassVar[str | None] = SKETCH

    keys: torch.Tensor  # [B, Hkv, W, D] model dtype
    values: torch.Tensor  # [B, Hkv, V, D] model dtype
    num_weight: torch.Tensor  # [B, Hkv, V] fp32
    den_weight: torch.Tensor  # [B, Hkv, W] fp32

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def batch_heads(self) -> tuple[int, int]:
        return self.keys.shape[0], self.keys.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def key_dtype(self) -> torch.dtype:
        return self.keys.dtype

    def attention_state(self, queries, positions: torch.Tensor, valid: torch.Tensor | None, state):
        """Fold the sketch into the online softmax `state` (positions, valid: the segment's per-slot [B, Hkv, W])."""
        batch, heads = self.batch_heads
        q = queries.grouped(heads)
        _, _, group, rows, dim = q.shape
        logits = (q.reshape(batch, heads, group * rows, dim) @ self.keys.float().transpose(-1, -2)).view(
            batch, heads, group, rows, -1) * queries.scaling
        if queries.softcap is not None:
            logits = torch.tanh(logits / queries.softcap) * queries.softcap
        logits = logits.masked_fill(~queries.allowed(positions, valid)[:, :, None], float("-inf"))
        m, l, acc = state
        m_new = torch.maximum(m, logits.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(logits - safe[..., None])
        correction = torch.exp(m - safe)
        l = l * correction + (p * self.den_weight[:, :, None, None]).sum(-1)
        width = self.values.shape[2]
        weighted = (p[..., :width] * self.num_weight[:, :, None, None]).reshape(batch, heads, group * rows, width)
        acc = acc * correction[..., None] + (weighted @ self.values.float()).view(acc.shape)
        return m_new, l, acc

    # -- the Payload protocol
    def gather(self, indices, real=None):
        raise ValueError("subgen holds its prompt as weighted samples; its slots cannot be evicted or reordered "
                         "(compose it with no other policy)")

    cat = flatten = gather

    def map_rows(self, fn) -> "Sketch":
        return Sketch(*(fn(t) for t in self.tensors()))

    def to(self, device) -> "Sketch":
        return Sketch(*(t.to(device) for t in self.tensors()))

    def detach(self) -> "Sketch":
        return self  # never written in place

    def dequantize(self, start: int, end: int, precision: int | None = None):
        return self.readable_keys(torch.float32)[:, :, start:end], self.readable_values(torch.float32)[:, :, start:end]

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        return self.keys.to(dtype=dtype, copy=True)

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        """Values over every slot (zeros where a slot holds none: a cluster sample's key only)."""
        batch, heads, width, dim = self.keys.shape
        out = self.values.new_zeros(batch, heads, width, self.values.shape[-1], dtype=dtype)
        out[:, :, :self.values.shape[2]] = self.values
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def shared_tensors(self) -> list[torch.Tensor]:
        return []

    def offloaded_nbytes(self) -> int:
        return 0


def store(layer, sketch: Sketch, positions: torch.Tensor, valid: torch.Tensor) -> None:
    """Make `layer`'s prompt the sketch (slots at original `positions` [B, Hkv, W], `valid` where real), with an empty
    tail behind it for the tokens to come."""
    tail = layer.tail
    batch, heads, _, dim = tail.data.keys.shape
    empty = tail.data.keys.new_empty(batch, heads, 0, dim)
    # the tail records its tokens' positions: the sketch's slots no longer say where the prompt ended
    no_positions = torch.zeros(batch, heads, 0, dtype=torch.int32, device=empty.device)
    layer.segments = [Segment(sketch, positions.to(torch.int32), valid),
                      Segment(FullPrecision(empty, empty.clone()), no_positions)]
    layer.explicit_positions = True
    layer.derived = {}
    layer.mark_changed()
