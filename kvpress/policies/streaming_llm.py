from dataclasses import dataclass

import torch

from .base import Context, ScorerPolicy, first_valid
from .registry import register


@register
@dataclass
class StreamingLLM(ScorerPolicy):
    """StreamingLLM (Xiao et al. 2024): `n_sink` attention sinks (the first real tokens of each row) plus a window
    of the newest tokens, trimmed at prefill and at every decode step. Capacity = budget, or n_sink + window.

    cache_local_positions=False keeps original positions (as NVIDIA kvpress does). True re-rotates keys so
    the kept tokens sit at contiguous positions right behind the query, as in the paper: each read rotates
    the stored (original-position) keys once by their offset, so no rounding error accumulates."""

    name = "streaming_llm"
    n_sink: int = 4
    window: int | None = None
    cache_local_positions: bool = False
    evicts_during_decode = True

    def __post_init__(self):
        if self.window is not None and self.budget is None and self.compression_ratio is None:
            if not isinstance(self.window, int) or self.window < 1:
                raise ValueError(f"streaming_llm: window={self.window!r}; allowed values: an int >= 1")
            self.budget = self.n_sink + self.window
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"streaming_llm: n_sink={self.n_sink!r}; allowed values: an int >= 0")
        if self.budget is not None:
            window = self.budget - self.n_sink if self.window is None else self.window
            if window < 1 or self.budget < self.n_sink + window:
                raise ValueError(
                    f"streaming_llm: budget={self.budget} is smaller than n_sink + window = "
                    f"{self.n_sink} + {window}; allowed values: budget >= n_sink + window with window >= 1"
                )

    def score(self, ctx: Context):
        return ctx.layer.key_positions().float()  # newest first, after the protected sinks

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        return first_valid(ctx.layer.key_valid(), torch.clamp(n_keep - 1, max=self.n_sink).clamp(min=0))

    @property
    def rewrites_keys(self) -> bool:
        return self.cache_local_positions

    def key_view(self, ctx: Context) -> torch.Tensor:
        if not self.cache_local_positions or not ctx.layer.is_compacted:
            return ctx.keys
        # Slot of rank r among a row's n real slots moves to position (newest position) - (n - 1 - r).
        valid = ctx.layer.key_valid()
        positions = ctx.layer.key_positions().long()
        rank = valid.cumsum(-1) - 1
        n_valid = valid.sum(-1, keepdim=True)
        newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)
        delta = (newest - (n_valid - 1 - rank)) - positions
        return rotate_keys(ctx.keys, delta.masked_fill(~valid, 0), ctx.rotary_inv_freq)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys [B, H, T, D] by `delta` [B, H, T] positions (half-split RoPE, as Llama-family
    models use). Rotations compose additively, so this re-indexes a key from position p to p + delta.
    Partial rotary (inv_freq shorter than D/2) rotates only the leading dims."""
    rot = 2 * inv_freq.numel()
    angles = delta[..., None].float() * inv_freq.to(keys.device).float()  # [B, H, T, rot/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = keys[..., :rot].float()
    half = rot // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    out = (x * cos + rotated_half * sin).to(keys.dtype)
    return torch.cat([out, keys[..., rot:]], -1) if rot < keys.shape[-1] else out
