from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.held import DerivedState
from .context import Context
from .protocol import Needs
from .sparse import ReadPolicy, slots_of
from .registry import register


@register
@dataclass
class RecycledAttention(ReadPolicy):
    """Recycled Attention / RefreshKV (Xu, Goyal, Choi; ACL 2025): the full cache is kept; most decode steps read a
    partial set C_p of `budget` slots, and a full step now and then reads every slot and rebuilds C_p from its own
    attention: the newest query row's probabilities, max over each KV head's query heads, max-pooled over
    `pool_kernel` neighbouring slots (SnapKV with an observation window of 1), top `budget` per KV head. The prompt's
    last token builds the first C_p. Between full steps, each token generated since the last one is read and pushes
    out the lowest-scored slot of C_p (by that full step's scores), so a partial step reads `budget` slots.

    Schedule, per layer: with `similarity` None, a full step every `stride` steps; with a float s, every `stride`
    steps the mean over query heads of the step's query is compared with the same mean at the row's last full step,
    and a row whose cosine falls below s takes a full step (the paper's dynamic schedule: stride = QC, 5 or 10;
    s = 0.85 to 0.95 by model). A row decides alone, so rows of a batch may refresh at different steps.

    Differences from the paper's text (no code is public), each named: a speculative draft over a target that is
    not recycled_attention has no prompt scores and takes a full step first; verification steps (several query
    rows) score by their newest row."""

    name = "recycled_attention"
    budget: int = 2048
    stride: int = 10
    similarity: float | None = None
    pool_kernel: int = 7

    def validate(self) -> None:
        super().validate()
        if self.stride < 1:
            raise ValueError(f"recycled_attention: stride={self.stride!r}; allowed values: an int >= 1")
        if self.similarity is not None and self.similarity != self.similarity:
            raise ValueError("recycled_attention: similarity=nan; allowed values: None (a fixed stride) or a float")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"recycled_attention: pool_kernel={self.pool_kernel!r}; allowed values: an odd int >= 1")

    def needs(self) -> Needs:
        return Needs(all_heads=True)  # the query fingerprint sums every head of the model

    @property
    def _key(self) -> tuple:  # this configuration's state in a layer (layer.derived)
        return ("recycled_attention", self.budget, self.stride, self.similarity, self.pool_kernel)

    def observe(self, ctx: Context) -> None:
        """At the prompt (each chunk; the last one stays): C_p from the prompt's last token, as a full step would."""
        if ctx.phase == "prefill":
            ctx.layer.derived[self._key] = _Partial.built(self, ctx, torch.ones(ctx.query.shape[0], dtype=torch.bool))

    def select(self, ctx: Context):
        layer = ctx.layer
        state = layer.derived.get(self._key)
        batch = ctx.query.shape[0]
        if state is None or not state.usable:
            full = torch.ones(batch, dtype=torch.bool, device=ctx.query.device)
        else:
            state.since += 1
            full = self._due(ctx, state)
        if not bool(full.any()):
            return state.partial_set(self.budget, layer.view_width)
        state = _Partial.built(self, ctx, full, state if state is not None and state.usable else None)
        layer.derived[self._key] = state
        # a row taking a full step reads every slot: as a mask, with the partial rows' slots
        real = layer.key_valid()
        indices, valid = state.partial_set(self.budget, layer.view_width)
        partial = torch.zeros_like(real).scatter_(-1, indices, valid) & real
        return slots_of(torch.where(full[:, None, None], real, partial))

    def _due(self, ctx: Context, state: "_Partial") -> torch.Tensor:
        """[B] rows that take a full step now."""
        batch = ctx.query.shape[0]
        if state.since < self.stride:
            return torch.zeros(batch, dtype=torch.bool, device=ctx.query.device)
        state.since = 0
        if self.similarity is None:
            return torch.ones(batch, dtype=torch.bool, device=ctx.query.device)
        now = _fingerprint(ctx)
        cos = (now * state.fingerprint).sum(-1) / (now.norm(dim=-1) * state.fingerprint.norm(dim=-1)).clamp(min=1e-30)
        return cos < self.similarity


def _fingerprint(ctx: Context) -> torch.Tensor:
    """[B, D]: the step's newest query row summed over every query head of the model (a mean, up to a scale)."""
    return ctx.shards.sum(ctx.query[:, :, -1].float().sum(1))


class _Partial(DerivedState):
    """A layer's recycled-attention state (layer.derived), per row: the slots of its C_p ranked by its last full step's
    scores (`ranked` [B, Hkv, budget], best first; `ranked_ok` False past a short head's slots), how many slots that
    step saw (`seen` [B]: later slots were generated since), its query fingerprint, and the steps since the last
    refresh or check."""

    def __init__(self, ranked, ranked_ok, seen, fingerprint):
        self.ranked, self.ranked_ok, self.seen, self.fingerprint = ranked, ranked_ok, seen, fingerprint
        self.since, self.usable = 0, True

    @classmethod
    def built(cls, policy: RecycledAttention, ctx: Context, rows: torch.Tensor, old: "_Partial | None" = None):
        """The state after a full step of `rows` [B] (the others keep `old`'s)."""
        layer = ctx.layer
        probs = ctx.attention_probs(last=1)[:, :, 0]  # [B, Hq, T]: the newest query row
        scores = ctx.to_kv_heads(probs, "max")
        k = policy.pool_kernel
        if k > 1:
            b, h, t = scores.shape
            scores = F.max_pool1d(scores.reshape(b * h, 1, t), k, 1, k // 2).view(b, h, t)
        scores = scores.masked_fill(~layer.key_valid(), float("-inf"))
        # max-pooling makes plateaus of equal scores: ties go to the older slot, so a padded row picks what it picks
        # alone (topk's choice among ties is the kernel's)
        ranked = scores.argsort(dim=-1, descending=True, stable=True)[..., :policy.budget]
        ranked_ok = torch.isfinite(scores.gather(-1, ranked))
        short = policy.budget - ranked.shape[-1]  # fewer slots than the budget: pad (never read)
        ranked, ranked_ok = F.pad(ranked, (0, short)), F.pad(ranked_ok, (0, short))
        seen = torch.full((scores.shape[0],), scores.shape[-1], device=scores.device)
        fingerprint = _fingerprint(ctx)
        if old is not None and not bool(rows.all()):
            keep = ~rows
            ranked = torch.where(keep[:, None, None], old.ranked, ranked)
            ranked_ok = torch.where(keep[:, None, None], old.ranked_ok, ranked_ok)
            seen = torch.where(keep, old.seen, seen)
            fingerprint = torch.where(keep[:, None], old.fingerprint, fingerprint)
        state = cls(ranked, ranked_ok, seen, fingerprint)
        if old is not None:
            state.since = old.since
        return state

    def partial_set(self, budget: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, valid) [B, Hkv, K] of a partial step: every slot generated since the row's full step, and the
        best (budget - generated) of its C_p."""
        n_generated = (width - self.seen).view(-1, 1, 1)  # [B, 1, 1]
        first = int(self.seen.min())
        generated = torch.arange(first, width, device=self.seen.device).expand(*self.ranked.shape[:2], -1)
        best = torch.arange(budget, device=self.seen.device) < budget - n_generated
        return (torch.cat([self.ranked, generated], -1),
                torch.cat([self.ranked_ok & best, generated >= self.seen.view(-1, 1, 1)], -1))

    def truncate(self, n_slots: int) -> None:
        """A rollback removed slots past n_slots: generated ones are simply gone; if it reaches into what a full step
        saw, the state no longer describes the layer and the next step is a full one."""
        if int(self.seen.max()) > n_slots:
            self.usable = False
