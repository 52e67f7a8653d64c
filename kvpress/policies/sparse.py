"""Sparse reads: nothing is evicted; at each decode step attention reads a selected subset of the stored slots.

A read policy implements `select(ctx) -> (indices [B, Hkv, K], valid [B, Hkv, K])` (slot numbers, ragged
counts padded with invalid entries). Used on its own (`patch_model(model, "quest", budget=512)`: decode and
verification steps read the selection) and as the cheap view that drafts in self-speculative decoding.
Selections always include the slots of the current query tokens. Per-page key statistics live in the
cache layer (`layer.derived`), extended as tokens arrive and cut back on rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.held import DerivedState
from ..kernels.slots import slots_of  # noqa: F401 (the read views' selection from a mask)
from .context import Context
from .protocol import Policy
from .roles import ReadView
from .registry import register
from .params import tokens


def leading_fillers(layer) -> torch.Tensor | None:
    """The layer's leading fillers [B, Hkv], None when no row has any. Pages, chunks and sinks count from a row's
    first real slot, so a padded row reads what it reads alone."""
    lead = layer.leading_fillers()
    return lead if lead is not None and bool(lead.any()) else None


class PageStats(DerivedState):
    """Per-page elementwise max / min / mean of the stored keys (real slots only), page_size slots a page, pages
    counted from each row/head's first real slot (`offset`, fixed when the statistics start: the layer drops
    them whenever it compacts). Complete pages are computed once; the partial last pages on every read."""

    def __init__(self, page_size: int, offset: torch.Tensor | None):
        self.page_size = page_size
        self.offset = offset  # [B, Hkv] leading filler slots, or None
        self.complete = 0  # pages whose statistics are final (for every row)
        self.kmax = self.kmin = self.kmean = None
        self.filled = None  # [B, Hkv, n_pages]: the page holds a real slot (an empty one is never worth reading)

    def truncate(self, n_slots: int) -> None:
        self.complete = min(self.complete, n_slots // self.page_size)

    def update(self, layer) -> "PageStats":
        P = self.page_size
        total = layer.view_width
        n_pages = (total + P - 1) // P
        start = self.complete * P
        if self.offset is None:
            keys = layer.keys_view()[:, :, start:].float()
            valid = layer.key_valid()[..., start:]
            pad = (n_pages - self.complete) * P - keys.shape[2]
            keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
            valid = torch.nn.functional.pad(valid, (0, pad))
        else:  # page slot j of a row is its slot j + offset
            src = torch.arange(start, n_pages * P, device=self.offset.device) + self.offset[..., None]
            keys, valid = _gathered(layer.keys_view(), layer.key_valid(), src)
        b, h = keys.shape[:2]
        k = keys.view(b, h, -1, P, keys.shape[-1])
        v = valid.view(b, h, -1, P, 1)
        new_max, new_min, new_mean = _summary(k, v, 3)
        keep = slice(0, self.complete)
        cat = (lambda old, new: new if old is None else torch.cat([old[:, :, keep], new], 2))
        self.kmax, self.kmin, self.kmean = cat(self.kmax, new_max), cat(self.kmin, new_min), cat(self.kmean, new_mean)
        self.filled = cat(self.filled, v.any(3)[..., 0])
        self.complete = (total - (0 if self.offset is None else int(self.offset.max()))) // P
        return self

    def first_page(self, slot: int) -> torch.Tensor | int:
        """The page ([B, Hkv], or an int without offsets) that holds view slot `slot` in each row."""
        return slot // self.page_size if self.offset is None else (slot - self.offset) // self.page_size

    def slots(self, pages: torch.Tensor, n_slots: int):
        """(slots [B, Hkv, K * page_size], valid) of the pages [B, Hkv, K] picked."""
        slots = (pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten(-2)
        if self.offset is not None:
            slots = slots + self.offset[..., None]
        return slots.clamp(max=n_slots - 1), slots < n_slots


def page_stats(layer, page_size: int) -> PageStats:
    if layer.captured:  # a captured step: the room's statistics, updated in place (built by prepare_step)
        return layer.room.derived[("pages", page_size)].update(layer)
    stats = layer.derived.get(("pages", page_size))
    if stats is None:
        stats = layer.derived[("pages", page_size)] = PageStats(page_size, leading_fillers(layer))
    return stats.update(layer)


class RoomPages(DerivedState):
    """Page statistics over a layer's room, for captured decode steps (cache/room.py): a buffer per statistic for
    every page the room's view can hold, built on the host from the layer's own (PageStats) before the first
    captured step, pages not yet reached empty; each step recomputes, in place, the pages its new tokens land in
    (the same max / min / mean over the same slots as PageStats), so the step keeps its shapes."""

    def __init__(self, layer, page_size: int):
        exact = page_stats(layer, page_size)
        self.page_size, self.offset = page_size, exact.offset
        width = layer.tail_start() + layer.room.capacity
        missing = (width + page_size - 1) // page_size - exact.kmax.shape[2]

        def padded(t, fill):
            return torch.cat([t, t.new_full((*t.shape[:2], missing, *t.shape[3:]), fill)], 2)

        self.kmax, self.kmin = padded(exact.kmax, float("-inf")), padded(exact.kmin, float("inf"))
        self.kmean, self.filled = padded(exact.kmean, 0.0), padded(exact.filled, False)
        for buffer in (self.kmax, self.kmin, self.kmean, self.filled):
            torch._dynamo.mark_static_address(buffer)

    def update(self, layer) -> "RoomPages":
        P, q_len = self.page_size, layer.room.pending
        keys, valid = layer.keys_view(), layer.key_valid()
        batch, heads, _, dim = keys.shape
        offset = 0 if self.offset is None else self.offset[..., None]  # [B, Hkv, 1]: a row's page 0 starts there
        for new in range(q_len):  # the page of each new token (a decode step: one)
            page = self.first_page(layer.first_new_slot(q_len) + new).expand(batch, heads)
            k, v = _gathered(keys, valid, page[..., None] * P + offset + torch.arange(P, device=keys.device))
            v = v[..., None]
            stats = _summary(k, v, 2)
            at = page[:, :, None, None].expand(-1, -1, 1, dim)
            for buffer, value in zip((self.kmax, self.kmin, self.kmean), stats):
                buffer.scatter_(2, at, value[:, :, None])
            self.filled.scatter_(2, page[:, :, None], v.any(2).expand(-1, -1, 1))
        return self

    def first_page(self, slot):
        return (slot - offset_of(self.offset)) // self.page_size

    slots = PageStats.slots


def offset_of(offset: torch.Tensor | None):
    return 0 if offset is None else offset


def _gathered(keys: torch.Tensor, valid: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys [B, Hkv, n, D] and validity [B, Hkv, n] of view slots `src` [B, Hkv, n] (slots past the view: not
    valid)."""
    width = keys.shape[2]
    inside = src < width
    src = src.clamp(max=width - 1)
    return keys.gather(2, src[..., None].expand(-1, -1, -1, keys.shape[-1])).float(), valid.gather(-1, src) & inside


def _summary(k: torch.Tensor, v: torch.Tensor, dim: int) -> tuple:
    """A page's statistics: elementwise (max, min, mean) of keys `k` over axis `dim`, real slots (`v`) only."""
    return (k.masked_fill(~v, float("-inf")).amax(dim), k.masked_fill(~v, float("inf")).amin(dim),
            (k * v).sum(dim) / v.sum(dim).clamp(min=1))


def sinks_and_window(real: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    """[B, Hkv, T] bool: each head's first `n_sink` and last `window` real slots (real: the layer's key_valid;
    fillers lead a head or sit anywhere, they are never chosen). What a view that decides slot by slot always
    reads."""
    rank = real.cumsum(-1) - 1  # each slot's index among its head's real slots
    return real & ((rank < n_sink) | (rank >= real.sum(-1, keepdim=True) - window))


def _from_page(score: torch.Tensor, first) -> torch.Tensor:
    """score [B, Hkv, n_pages] with every page from `first` (an int, or [B, Hkv]) on set to +inf (always read)."""
    if isinstance(first, int):
        score[..., max(0, first):] = float("inf")
        return score
    pages = torch.arange(score.shape[-1], device=score.device)
    return score.masked_fill(pages >= first[..., None], float("inf"))


def _top_pages(score: torch.Tensor, n: int, most_forced: int, stats: "PageStats", width: int):
    """(slots, valid) of the `n` best pages of `score` [B, Hkv, n_pages] per head, and of every page that must be read
    (+inf; at most `most_forced`) when those are more: each head reads max(n, its forced pages), so no choice is
    left to how topk breaks ties among forced pages (a padded row then reads what it reads alone). The sizes
    depend on n and most_forced only (a captured step reads no count from the device)."""
    per_head = torch.isposinf(score).sum(-1).clamp(min=n)  # [B, Hkv]
    top = score.topk(min(score.shape[-1], max(n, most_forced)), dim=-1)
    pages, order = top.indices.sort(-1)
    taken = torch.arange(pages.shape[-1], device=pages.device) < per_head[..., None]  # in the topk's own order
    slots, valid = stats.slots(pages, width)
    return slots, valid & taken.gather(-1, order).repeat_interleave(stats.page_size, -1)


def _query_rows(ctx: Context) -> torch.Tensor:
    """[B, Hkv, g*r, D]: this step's query rows grouped under their KV head."""
    b, hq, r, d = ctx.query.shape
    return ctx.query.reshape(b, hq // ctx.group_size, ctx.group_size * r, d).float()


@dataclass
class ReadPolicy(ReadView):
    """A read view that reads at most about `budget` slots per KV head at each decode step."""

    budget: int = 512

    def validate(self) -> None:
        if self.budget < 1:  # its kind (an int) is checked from the annotation
            raise ValueError(f"{self.name}: budget={self.budget!r}; allowed values: an int >= 1")


@register
@dataclass
class Quest(ReadPolicy):
    """Quest (Tang et al. 2024): pages of `page_size` slots with elementwise min/max keys; a page's score is
    sum_d max(q_d M_d, q_d m_d), an upper bound of q.k for every key in it. Per KV head (max over its query
    heads and rows), the top budget/page_size pages are read; the current page always is."""

    name = "quest"
    captures: ClassVar[bool] = True
    budget: int = 512
    page_size: int = tokens(16)

    def prepare_step(self, layer) -> None:
        if ("pages", self.page_size) not in layer.room.derived:
            layer.room.derived[("pages", self.page_size)] = RoomPages(layer, self.page_size)

    def validate(self) -> None:
        super().validate()
        if self.page_size < 1:
            raise ValueError(f"quest: page_size={self.page_size!r}; allowed values: an int >= 1")

    def select(self, ctx: Context):
        stats = page_stats(ctx.layer, self.page_size)
        q = _query_rows(ctx)  # [B, Hkv, M, D]
        bound = torch.maximum(q[:, :, :, None] * stats.kmax[:, :, None], q[:, :, :, None] * stats.kmin[:, :, None])
        score = bound.nan_to_num(neginf=-1e30).sum(-1).amax(2)  # [B, Hkv, n_pages]
        score = _from_page(score, stats.first_page(ctx.layer.first_new_slot(ctx.q_len)))  # the current page(s)
        score = score.masked_fill(~stats.filled, float("-inf"))
        return _top_pages(score, max(1, self.budget // self.page_size), ctx.q_len // self.page_size + 2, stats,
                          ctx.layer.view_width)


@register
@dataclass
class Retrieval(ReadPolicy):
    """TriForce-style retrieval: chunks of `chunk_size` (8) slots scored by q . mean key of the chunk (max over
    the KV head's query heads and rows); the first chunk (sinks) and the chunks holding the last `recent`
    slots are always read; the best other chunks fill the budget (default 4096 tokens)."""

    name = "retrieval"
    budget: int = 4096
    chunk_size: int = tokens(8)
    recent: int = 64

    def validate(self) -> None:
        super().validate()
        if self.chunk_size < 1:
            raise ValueError(f"retrieval: chunk_size={self.chunk_size!r}; allowed values: an int >= 1")
        if self.recent < 0:
            raise ValueError(f"retrieval: recent={self.recent!r}; allowed values: an int >= 0")

    def select(self, ctx: Context):
        c = self.chunk_size
        stats = page_stats(ctx.layer, c)
        score = torch.einsum("bhmd,bhnd->bhmn", _query_rows(ctx), stats.kmean).amax(2)  # [B, Hkv, n_chunks]
        score[..., 0] = float("inf")
        score = _from_page(score, stats.first_page(max(0, ctx.layer.view_width - max(self.recent, ctx.q_len))))
        score = score.masked_fill(~stats.filled, float("-inf"))
        return _top_pages(score, max(1, self.budget // c), max(self.recent, ctx.q_len) // c + 3, stats,
                          ctx.layer.view_width)


@register
@dataclass
class TopK(ReadPolicy):
    """Exact top-`budget` slots by q . k per KV head (max over its query heads and rows): the oracle that
    page/chunk selection approximates. Scores every key, so it saves no reading; a quality baseline."""

    name = "topk"

    def select(self, ctx: Context):
        logits = ctx.key_logits(ctx.query)  # [B, Hkv, g, r, T]
        score = logits.amax(2).amax(2).masked_fill(~ctx.layer.key_valid(), float("-inf"))
        score[..., ctx.layer.view_width - ctx.q_len:] = float("inf")
        n = min(score.shape[-1], self.budget)
        idx = score.topk(n, dim=-1).indices.sort(-1).values
        return idx, torch.ones_like(idx, dtype=torch.bool)


@register
@dataclass
class SinkWindow(ReadPolicy):
    """Reads `n_sink` first slots + the newest (budget - n_sink): the StreamingLLM view (MagicDec's draft),
    at original positions."""

    name = "sink_window"
    n_sink: int = 4

    def validate(self) -> None:
        super().validate()
        if self.n_sink < 0:
            raise ValueError(f"sink_window: n_sink={self.n_sink!r}; allowed values: an int >= 0")
        if self.budget <= self.n_sink:
            raise ValueError(f"sink_window: budget={self.budget} must exceed n_sink={self.n_sink}; "
                             f"allowed values: budget > n_sink")

    def select(self, ctx: Context):
        total = ctx.layer.view_width
        window = max(self.budget - self.n_sink, ctx.q_len)
        shape, device = ctx.keys.shape[:2], ctx.keys.device
        sinks = torch.arange(self.n_sink, device=device).expand(*shape, -1)
        lead = leading_fillers(ctx.layer)
        if lead is not None:  # each row's sinks are its first real slots
            sinks = sinks + lead[..., None]
        start = max(0, total - window)
        newest = torch.arange(start, total, device=device).expand(*shape, -1)
        return torch.cat([sinks.clamp(max=total - 1), newest], -1), torch.cat(
            [sinks < start, torch.ones_like(newest, dtype=torch.bool)], -1)  # a sink inside the window: read once


@dataclass
class Quant4View(Policy):
    """QuantSpec-style draft view: layers stored with 8-bit KIVI codes are read through the upper 4 bits of
    each code (the same storage, half the information); the full-precision residual is read as is.
    Only meaningful as a draft view (speculative_generate(draft="quant4")), so it is not registered."""

    name = "quant4_view"
    read_precision: ClassVar[int | None] = 4
