from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..cache.held import DerivedState
from ..formats.calibration import Calibration
from ..heads import HeadShards
from .context import Context
from .protocol import ModelInfo
from .sparse import ReadPolicy, page_stats, sinks_and_window, slots_of
from .registry import register
from .params import tokens


@register
@dataclass
class LServe(ReadPolicy):
    """LServe (Yang et al., MLSys 2025) decode reads: two sparsities at once. Static: the `static_sparsity` fraction of
    (layer, KV head) pairs are streaming heads (those whose output changes least when they read sinks + window only:
    the calibration file's DuoAttention measure), which read their first `n_sink` and last `local` tokens. Dynamic:
    the other heads read about `budget` tokens in pages of `page_size`; each page is split into `sub_pages` logical
    pages with per-channel key min / max, a logical page scores Quest's bound sum_d max(q_d max_d, q_d min_d), a
    page its best logical page (max over the KV head's query heads and rows); the top max(3, budget / page_size) - 1
    pages among all but the last, plus the last, are read. The selection is reused while a row's token count is not
    a multiple of `reuse_interval`; a reused selection always adds the page of the step's own tokens.

    Differences from the official code (mit-han-lab/omniserve), each named: a read view only, so the streaming heads'
    tokens stay stored (LServe keeps them in a separate small pool; compose duo_attention's eviction yourself for the
    bytes); the prefill stays dense (LServe's streaming heads prefill with a sink + local mask); heads come from our
    calibration measure, not DuoAttention's learned gates; selection per KV head (max over its query heads); budgets
    need not be multiples of the page size."""

    name = "lserve"
    budget: int = 4096
    page_size: int = tokens(64)
    sub_pages: int = 4
    reuse_interval: int = 4
    static_sparsity: float = 0.5
    n_sink: int = 128
    local: int = 256
    calibration: str | None = None
    # {layer_idx: [Hkv] bool} streaming heads, resolved from the calibration file when patching
    heads: object = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.page_size < 1 or self.sub_pages < 1 or self.page_size % self.sub_pages:
            raise ValueError(f"lserve: page_size={self.page_size!r}, sub_pages={self.sub_pages!r}; allowed values: "
                             f"ints >= 1, sub_pages dividing page_size")
        if self.reuse_interval < 1:
            raise ValueError(f"lserve: reuse_interval={self.reuse_interval!r}; allowed values: an int >= 1")
        if not 0.0 <= self.static_sparsity <= 1.0:
            raise ValueError(f"lserve: static_sparsity={self.static_sparsity!r}; allowed values: a fraction in [0, 1] "
                             f"of the model's (layer, KV head) pairs")
        for name in ("n_sink", "local"):
            if getattr(self, name) < 0:
                raise ValueError(f"lserve: {name}={getattr(self, name)!r}; allowed values: an int >= 0")

    def for_model(self, model: ModelInfo) -> "LServe":
        if self.heads is not None or self.static_sparsity == 0:
            return self
        calibration = Calibration.for_model(model, self.calibration)
        return dataclasses.replace(self, heads=calibration.streaming_heads(self.static_sparsity))

    @property
    def _key(self) -> tuple:  # this configuration's page selection in a layer (layer.derived)
        return ("lserve", self.budget, self.page_size, self.sub_pages)

    def select(self, ctx: Context):
        layer = ctx.layer
        real = layer.key_valid()
        streaming = self._streaming(ctx)  # [Hkv]
        window = sinks_and_window(real, self.n_sink, max(self.local, ctx.q_len))
        chosen = torch.where(streaming[None, :, None], window, self._pages(ctx, real.sum(-1)))
        return slots_of(chosen & real)

    def _streaming(self, ctx: Context) -> torch.Tensor:
        hkv = ctx.layer.num_kv_heads
        if self.heads is None:
            return torch.zeros(hkv, dtype=torch.bool, device=ctx.query.device)
        return HeadShards.block_of(self.heads[ctx.layer_idx], hkv).to(ctx.query.device)

    def _pages(self, ctx: Context, n_real: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, T] the slots of the retrieval heads' pages (all of them where a row fits the budget)."""
        layer = ctx.layer
        width = layer.view_width
        logical = self.page_size // self.sub_pages
        stats = page_stats(layer, logical)
        current = stats.first_page(layer.first_new_slot(ctx.q_len)) // self.sub_pages  # the page of the step's tokens
        cached = layer.derived.get(self._key)
        due = (n_real % self.reuse_interval == 0).any(-1)  # [B] rows that select now
        if cached is None or not cached.usable or bool(due.any()):
            picked = self._pick(ctx, stats, current)
            if cached is not None and cached.usable and cached.pages.shape == picked.shape:
                picked = torch.where(due[:, None, None], picked, cached.pages)
            layer.derived[self._key] = cached = _PageSelection(picked)
        pages = cached.pages
        if not isinstance(current, int):
            current = current[..., None]
        pages = torch.cat([pages, torch.as_tensor(current, device=pages.device).expand(*pages.shape[:2], 1)], -1)
        # a page's logical pages, then their slots
        logical_pages = (pages[..., None] * self.sub_pages + torch.arange(self.sub_pages, device=pages.device))
        slots, ok = stats.slots(logical_pages.flatten(-2), width)
        chosen = torch.zeros(*slots.shape[:2], width + 1, dtype=torch.bool, device=slots.device)
        chosen.scatter_(-1, torch.where(ok, slots, width), True)
        own = torch.arange(width, device=slots.device) >= width - ctx.q_len  # (a verification's tokens: several pages)
        return chosen[..., :width] | own | (n_real <= self.budget)[..., None]

    def _pick(self, ctx: Context, stats, current) -> torch.Tensor:
        """[B, Hkv, n] the best pages but the current one, by their best logical page's bound."""
        b, hq, r, d = ctx.query.shape
        q = ctx.query.reshape(b, hq // ctx.group_size, ctx.group_size * r, d).float()
        bound = torch.maximum(q[:, :, :, None] * stats.kmax[:, :, None], q[:, :, :, None] * stats.kmin[:, :, None])
        score = bound.nan_to_num(neginf=-1e30).sum(-1).amax(2)  # [B, Hkv, logical pages]
        score = score.masked_fill(~stats.filled, float("-inf"))
        n_logical = score.shape[-1]
        pad = -n_logical % self.sub_pages
        score = torch.nn.functional.pad(score, (0, pad), value=float("-inf"))
        score = score.view(*score.shape[:2], -1, self.sub_pages).amax(-1)  # [B, Hkv, pages]
        pages = torch.arange(score.shape[-1], device=score.device)
        last = current if isinstance(current, int) else current[..., None]
        score = score.masked_fill(pages >= last, float("-inf"))  # the current page is added at every step
        n = min(score.shape[-1], max(3, self.budget // self.page_size) - 1)
        return score.argsort(dim=-1, descending=True, stable=True)[..., :n]


class _PageSelection(DerivedState):
    """A layer's last page selection (layer.derived) [B, Hkv, n]; a rollback voids it (the next step selects anew)."""

    def __init__(self, pages: torch.Tensor):
        self.pages, self.usable = pages, True

    def truncate(self, n_slots: int) -> None:
        self.usable = False
