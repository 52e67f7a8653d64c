from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .context import Context
from .scorer import ScorerPolicy
from .selection import last_slots
from .registry import register


@register
@dataclass
class SnapKV(ScorerPolicy):
    """SnapKV (Li et al. 2024): at prefill, the last `window_size` prompt queries vote (softmax over all keys,
    window columns then dropped), votes are pooled along the sequence (`pooling` 'max' or 'avg', odd
    `kernel_size`) and averaged over each GQA group; each KV head keeps its top slots plus the window.
    No eviction while decoding. Defaults follow the paper's LongBench configs (window 32, kernel 7, max).
    The budget counts the window; if a row's budget is below the window, only its last `budget` tokens stay."""

    name = "snapkv"
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def validate(self) -> None:
        super().validate()
        check_window_and_pooling(self.name, self.window_size, self.kernel_size, self.pooling, self.budget)

    def query_rows(self) -> int:
        return self.window_size  # the observation window votes

    @property
    def kept_window(self) -> int:
        return self.window_size

    def check_chunking(self, chunk_size: int) -> None:
        if chunk_size < self.window_size:
            raise ValueError(
                f"prefill_chunk_size={chunk_size} is smaller than {self.name}'s window_size={self.window_size}: each "
                f"chunk's last window_size queries vote; allowed values: prefill_chunk_size >= {self.window_size}")

    def score(self, ctx: Context):
        votes = ctx.attention_probs(last=min(self.window_size, ctx.q_len)).sum(2)  # [B, Hq, T]
        return pooled_votes(ctx.layer, votes, self._window(ctx), self.kernel_size, self.pooling)

    def _window(self, ctx: Context, n_keep: torch.Tensor | None = None) -> torch.Tensor:
        return window_slots(ctx.layer, min(self.window_size, ctx.q_len), n_keep)

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        return self._window(ctx, n_keep)


def check_window_and_pooling(name: str, window_size: int, kernel_size: int, pooling: str, budget: int | None) -> None:
    """Raise ValueError unless SnapKV's observation window and pooling are valid (SnapKV's, and LAQ's stage 2):
    the window is kept whole, so an absolute budget holds it."""
    if window_size < 1:
        raise ValueError(f"{name}: window_size={window_size!r}; allowed values: an int >= 1")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"{name}: kernel_size={kernel_size!r}; allowed values: an odd int >= 1")
    if pooling not in ("max", "avg"):
        raise ValueError(f"{name}: pooling={pooling!r}; allowed values: 'max', 'avg'")
    if budget is not None and budget < window_size:
        raise ValueError(f"{name}: budget={budget} is smaller than window_size={window_size}; "
                         f"allowed values: budget >= window_size")


def window_slots(layer, window: int, n_keep: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, T] the newest `window` real slots of each row and head (at most n_keep [B, Hkv] of them): the
    observation window, always kept."""
    valid = layer.key_valid()
    n = torch.full(valid.shape[:2], window, device=valid.device)
    return last_slots(layer, n if n_keep is None else torch.minimum(n, n_keep), among=valid)


def pooled_votes(layer, votes: torch.Tensor, window: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's scores [B, Hkv, T] from attention `votes` [B, Hq, T] summed over the observation rows: the window's
    own columns dropped (they are kept anyway, as in the reference), pooled along the sequence ('max' or 'avg',
    odd `kernel_size`), averaged over each GQA group."""
    group = votes.shape[1] // layer.num_kv_heads
    votes = votes.masked_fill(window.repeat_interleave(group, 1), 0.0)
    # Pooled over each head's real slots in slot order: invalid filler slots between them (rows of a batch that
    # keep different counts) must not widen a neighbourhood, or a row would score unlike itself alone
    valid = layer.key_valid().repeat_interleave(group, 1)
    order = (~valid).long().argsort(dim=-1, stable=True)  # real slots first, in slot order
    outside = float("-inf") if pooling == "max" else 0.0  # what the pooling's own padding stands for
    packed = votes.gather(-1, order).masked_fill(~valid.gather(-1, order), outside)
    pad = kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(packed, kernel_size, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(packed, kernel_size, stride=1, padding=pad)
    pooled = torch.zeros_like(pooled).scatter_(-1, order, pooled).masked_fill(~valid, 0.0)
    batch, hq, width = pooled.shape
    return pooled.view(batch, hq // group, group, width).mean(2)
