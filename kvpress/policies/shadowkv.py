"""ShadowKV (Sun et al., ICML 2025): the prompt's keys kept as a low-rank factorisation of their pre-RoPE form, its
values moved to a second tier, and each decode step reading only the chunks its query selects by their landmarks.

At the end of a one-shot prefill each layer's prompt becomes one ShadowKV segment (cache/shadow.py, which also
reads it). Per row (a padded batch's rows each on their own real tokens, as alone):
  1. keys are un-rotated to their pre-RoPE form and factorised, every KV head side by side ([T, Hkv * D]), by a
     truncated SVD of rank `rank`: coefficients per token and a basis per head stay in memory;
  2. the prompt is cut into chunks of `chunk_size` tokens from its first real token; the last `local_chunks`
     chunks and the unaligned end stay exact;
  3. each other chunk's landmark is the mean of its post-RoPE keys; per KV head the `outlier_chunks` chunks whose
     least similar key (cosine to the mean) is lowest stay exact and are no landmark;
  4. every value goes to the file tier (a memory-mapped file; on a GPU the paper's tier is pinned host memory).
A read scores the landmarks with softmax(q . landmark / sqrt(D)) per query head, summed over the query rows and
maxed over the GQA group, takes the top budget / chunk_size chunks per KV head, rebuilds their keys and fetches
their values: each step reads budget + exact slots of the prompt, plus every generated token.

Differences from the official code (bytedance/ShadowKV@a21f5a9, `ShadowKVCache`): `rank` defaults to the paper's
share of the key width, 160 of 1024 (Llama-3-8B), rounded up, instead of 160 for every model; landmark logits use
the model's own scaling (1/sqrt(D)), not a hard-coded 1/sqrt(128); the values really leave memory (the official
accuracy class keeps them on the GPU); padded batches are supported (the official accuracy class takes one row);
a prompt with fewer selectable chunks than the budget is read whole (the official code asserts); a budget that is
not a multiple of chunk_size is rounded down to whole chunks (at least one). The paper's rank share is too low for
SmolLM2-135M's 3 x 64 keys. At 8K (n = 20 per task), rank 30 loses 5.8 +- 3.1 points against the full cache, and
rank 64 still loses 4.0 +- 2.3 with 29% of the full cache's bytes in memory instead of 20%
(docs/results/shadowkv_8k_n20). The selection is not the cause: with full-rank factors it loses 0.4 +- 2.3
(docs/results/shadowkv_8k_ablation). `rank` sets it.

`ShadowKVView` is the same selection as a self-speculative draft (speculative_generate(draft="shadowkv")) over the
target's exact cache: it reads the chosen chunks' stored keys, as the target's cache must stay exact to verify.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..cache.held import DerivedState
from ..cache.shadow import FileTier, ShadowKeys, chosen_chunks, store
from ..positions import unrotate
from .context import Context
from .protocol import Needs
from .registry import register
from .roles import StorageTier
from .sparse import ReadPolicy
from .params import tokens

PAPER_RANK_SHARE = 160 / 1024  # the official rank over Llama-3-8B's key width (8 KV heads x 128)


@dataclass
class _Chunking:
    """The hyper-parameters of ShadowKV's chunk plan, shared by the storage policy and the draft view."""

    budget: int = 2048  # tokens of selected chunks read per step (per KV head)
    chunk_size: int = tokens(8)
    local_chunks: int = 4
    outlier_chunks: int = 48

    def validate(self) -> None:
        for field, least in (("budget", 1), ("chunk_size", 1), ("local_chunks", 0), ("outlier_chunks", 0)):
            if getattr(self, field) < least:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}; allowed values: an int >= {least}")

    @property
    def select_chunks(self) -> int:
        return max(1, self.budget // self.chunk_size)

    def plan(self, layer) -> dict:
        """The chunk plan of a rectangular layer's slots (post-RoPE keys; fillers lead a padded row, the same in every
        head): per row, from its first real slot, `landmarks` [B, Hkv, N, D] with `starts` (each chunk's first slot)
        and `landmark_ok`, and the `exact` slots [B, Hkv, E] (outlier and local chunks, the unaligned end) with
        `exact_ok`; `lead` each row's fillers (a list)."""
        keys, fillers = layer.keys_view(), layer.leading_fillers()
        lead = [0] * keys.shape[0] if fillers is None else fillers[:, 0].tolist()
        rows = [self._row_plan(keys[b, :, lead[b]:].float(), lead[b]) for b in range(keys.shape[0])]
        landmarks, landmark_ok = _stacked([r[0] for r in rows], 0.0)
        starts, _ = _stacked([r[1] for r in rows], 0)
        exact, exact_ok = _stacked([r[2] for r in rows], 0)
        return dict(landmarks=landmarks, starts=starts, landmark_ok=landmark_ok, exact=exact, exact_ok=exact_ok,
                    lead=lead)

    def _row_plan(self, keys: torch.Tensor, lead: int) -> tuple:
        """keys [Hkv, L, D] of one row's real tokens -> (landmarks [Hkv, n', D], starts [Hkv, n'], exact slots)."""
        heads, length, dim = keys.shape
        c, device = self.chunk_size, keys.device
        n = max(0, length // c - self.local_chunks)  # chunks before the local ones: outliers or landmarks
        chunks = keys[:, :n * c].view(heads, n, c, dim)
        means = chunks.mean(2)
        similarity = torch.nn.functional.cosine_similarity(chunks, means[:, :, None], dim=-1).amin(-1)  # [Hkv, n]
        outliers = similarity.topk(min(self.outlier_chunks, n), largest=False).indices.sort(-1).values
        rest = torch.ones(heads, n, dtype=torch.bool, device=device).scatter_(1, outliers, False)
        others = torch.arange(n, device=device).expand(heads, n)[rest].view(heads, n - outliers.shape[1])
        outlier_slots = (outliers[..., None] * c + torch.arange(c, device=device)).flatten(1)
        local = torch.arange(n * c, length, device=device).expand(heads, -1)
        return (means.gather(1, others[..., None].expand(-1, -1, dim)), others * c + lead,
                torch.cat([outlier_slots, local], 1) + lead)


@register
@dataclass
class ShadowKV(_Chunking, StorageTier):
    """ShadowKV: low-rank pre-RoPE keys, values in a file tier, landmark-selected chunks read per step (module
    docstring)."""

    @classmethod
    def draft_view(cls) -> type | None:
        return ShadowKVView  # its chunk selection over an exact cache (defined below)

    name = "shadowkv"
    rank: int | None = None  # None: the paper's share of Hkv * head_dim
    offload_dir: str | None = None  # the file tier's folder (None: $KVPRESS_OFFLOAD_DIR, else the temp folder)

    def validate(self) -> None:
        super().validate()
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"shadowkv: rank={self.rank!r}; allowed values: None or an int >= 1")
        if self.offload_dir is not None and not os.path.isdir(self.offload_dir):
            raise ValueError(f"shadowkv: offload_dir={self.offload_dir!r} is not a folder; allowed values: None or "
                             f"an existing folder")
        tier = FileTier(self.offload_dir)
        if (kind := tier.memory_filesystem()) is not None:
            raise ValueError(f"shadowkv: offload_dir={self.offload_dir!r} puts the values in {tier.folder!r}, a {kind} "
                             f"folder that keeps its files in RAM; allowed values: a folder on disk (offload_dir, or "
                             f"$KVPRESS_OFFLOAD_DIR)")

    def needs(self) -> Needs:
        return Needs(rotary=True)

    def for_model(self, model) -> "ShadowKV":
        tier = FileTier(self.offload_dir)
        if (why := tier.writable()) is not None:
            raise ValueError(f"shadowkv: offload_dir={self.offload_dir!r}: no file can be written in {tier.folder!r} "
                             f"({why}); allowed values: a writable folder on disk (offload_dir, or $KVPRESS_OFFLOAD_DIR)")
        width = model.config.num_key_value_heads * model.head_dim
        if self.rank is not None and self.rank > width:
            raise ValueError(f"shadowkv: rank={self.rank} exceeds the keys' width (KV heads x head_dim = {width}); "
                             f"allowed values: None or 1..{width}")
        return self

    def check_chunking(self, chunk_size: int) -> None:
        raise ValueError(f"prefill_chunk_size={chunk_size}: shadowkv factorises each layer's whole prompt at once; "
                         f"allowed values: None")

    def rank_for(self, heads: int, dim: int) -> int:
        return self.rank if self.rank is not None else math.ceil(PAPER_RANK_SHARE * heads * dim)

    def on_prefill(self, ctx: Context) -> None:
        layer = ctx.layer
        keys, values = layer.tail.data.keys, layer.tail.data.values  # the whole prompt: one rectangle
        batch, heads, width, dim = keys.shape
        plan = self.plan(layer)
        rope = ctx.query_rope_positions()
        if rope.shape[1] != width:  # a Context of a prompt's last query rows (a serving engine's): slot j at j
            rope = torch.arange(width, device=keys.device).expand(batch, width)
        rank = self.rank_for(heads, dim)
        coeffs, basis = keys.new_zeros(batch, 1, width, rank), keys.new_zeros(batch, heads, rank, dim)
        for b, lead in enumerate(plan["lead"]):  # each row's own factorisation, of its real tokens
            u, sv = self._factors(keys[b, :, lead:], rope[b, lead:], ctx.rotary, rank)
            coeffs[b, 0, lead:, :u.shape[1]], basis[b, :, :u.shape[1]] = u, sv
        take = plan["exact"][..., None].expand(-1, -1, -1, dim)
        tier = FileTier(self.offload_dir)
        store(layer, ShadowKeys(coeffs, basis, rope.to(torch.int32).contiguous(), plan["landmarks"].to(keys.dtype),
                                plan["starts"], plan["landmark_ok"], plan["exact"], plan["exact_ok"],
                                keys.gather(2, take), values.gather(2, take), tier.put(values), self.chunk_size,
                                self.select_chunks, ctx.rotary, tier))

    @staticmethod
    def _factors(keys: torch.Tensor, rope: torch.Tensor, rotary, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's post-RoPE keys [Hkv, L, D] at RoPE positions [L] -> (coefficients [L, r'], basis [Hkv, r', D]),
        r' = min(rank, L, Hkv * D): the truncated SVD of the pre-RoPE keys, heads side by side."""
        heads, length, dim = keys.shape
        cos, sin = rotary.cos_sin(rope[None], keys.float())
        pre = unrotate(keys[None], cos, sin)[0]  # [Hkv, L, D] fp32
        u, s, vh = torch.linalg.svd(pre.transpose(0, 1).reshape(length, heads * dim), full_matrices=False)
        r = min(rank, s.numel())
        return u[:, :r].to(keys.dtype), (s[:r, None] * vh[:r]).view(r, heads, dim).transpose(0, 1).to(keys.dtype)


@dataclass
class ShadowKVView(_Chunking, ReadPolicy):
    """ShadowKV's chunk selection as a draft view over an exact cache (not registered: speculative_generate's
    draft="shadowkv"). The plan is made from the stored keys at the first read of a layer; slots stored after it
    are always read, as ShadowKV reads every generated token."""

    name = "shadowkv_view"

    def select(self, ctx: Context):
        layer = ctx.layer
        key = ("shadowkv", self.chunk_size, self.local_chunks, self.outlier_chunks)
        plan = layer.derived.get(key)
        if plan is None or plan.stale:
            plan = layer.derived[key] = _ViewPlan(self.plan(layer), layer.view_width)
        query = ctx.query.view(*layer.batch_heads, ctx.group_size, *ctx.query.shape[2:]).float()
        slots, ok = chosen_chunks(query, ctx.scaling, plan.plan["landmarks"], plan.plan["landmark_ok"],
                                  plan.plan["starts"], self.select_chunks, self.chunk_size)
        newer = torch.arange(plan.width, layer.view_width, device=slots.device).expand(*slots.shape[:2], -1)
        return (torch.cat([slots, plan.plan["exact"], newer], -1),
                torch.cat([ok, plan.plan["exact_ok"], torch.ones_like(newer, dtype=torch.bool)], -1))


class _ViewPlan(DerivedState):
    """A draft view's chunk plan in layer.derived, made over the first `width` slots; a rollback below them makes
    it stale (a new plan at the next read)."""

    def __init__(self, plan: dict, width: int):
        self.plan, self.width, self.stale = plan, width, False

    def truncate(self, n_slots: int) -> None:
        self.stale = self.stale or n_slots < self.width


def _stacked(parts: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' [Hkv, n_b, ...] tensors as one [B, Hkv, max n_b, ...] (padded with `fill`) and which entries are real."""
    width = max(p.shape[1] for p in parts)
    out = parts[0].new_full((len(parts), parts[0].shape[0], width, *parts[0].shape[2:]), fill)
    ok = torch.zeros(len(parts), parts[0].shape[0], width, dtype=torch.bool, device=parts[0].device)
    for b, p in enumerate(parts):
        out[b, :, :p.shape[1]] = p
        ok[b, :, :p.shape[1]] = True
    return out, ok
