from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.held import DerivedState
from .context import Context
from .protocol import Needs
from .sparse import ReadPolicy, sinks_and_window, slots_of
from .registry import register


@register
@dataclass
class TokenSelect(ReadPolicy):
    """TokenSelect (Wu et al. 2024): each decode step reads a row's first `n_init` tokens, its last `n_local` and the
    top_k = budget - n_init - n_local tokens in between by a soft vote of every query head: with f the mean of the
    step's query rows, s_hj = f_h . k_j / temperature and S_j = sum over heads of softmax_j(s_h) over the
    candidates, so no head with huge logits decides alone. One index set serves every KV head of the layer (summed
    over all heads model-wide under tensor parallelism). Selection cache: while cos(f, f_sel) >= reuse_threshold,
    with f_sel the query of the step that last selected (per row, over every head's channels), the previous top_k
    is read again without scoring. A row that holds at most `budget` tokens reads them all.

    n_init / n_local default to the official configs' proportions (128 : 2048 : 512 of budget 2688). Differences
    from the official code (pzs19/TokenSelect), each named:
    - decode and verification steps only: the prefill stays dense (the reference also selects per 512-row chunk);
    - original positions: the reference's cache-local positions (length extrapolation) need pre-RoPE keys;
    - the selection cache is built from the paper's description (the release disables it, and its reuse branch
      does not run); query heads map to KV heads by GQA groups (the release's Triton kernel pairs h with h mod Hkv);
    - `temperature` makes the vote's sharpness a parameter (1: the reference's, no 1/sqrt(D));
    - over a cache cut per head (a draft over a compressed target) the heads share slot numbers, not tokens."""

    name = "token_select"
    budget: int = 2688
    n_init: int | None = None
    n_local: int | None = None
    temperature: float = 1.0
    pool_kernel: int = 0  # max-pool of the vote over neighbouring slots (the per-dataset kernels; 0: off)
    reuse_threshold: float = 0.9

    def validate(self) -> None:
        super().validate()
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"token_select: {name}={value!r}; allowed values: None or an int >= 0")
        if self.top_k < 1:
            raise ValueError(f"token_select: budget={self.budget} leaves no top_k after n_init={self.init} and "
                             f"n_local={self.local}; allowed values: budget > n_init + n_local")
        if not self.temperature > 0:
            raise ValueError(f"token_select: temperature={self.temperature!r}; allowed values: a float > 0")
        if self.pool_kernel < 0 or (self.pool_kernel and self.pool_kernel % 2 == 0):
            raise ValueError(f"token_select: pool_kernel={self.pool_kernel!r}; allowed values: 0 (off) or an odd "
                             f"int >= 1")
        if self.reuse_threshold != self.reuse_threshold:
            raise ValueError("token_select: reuse_threshold=nan; allowed values: a float (> 1: never reuse)")

    def needs(self) -> Needs:
        return Needs(all_heads=True)  # the vote and the query's closeness sum every head of the model

    @property
    def init(self) -> int:
        return self.budget // 21 if self.n_init is None else self.n_init

    @property
    def local(self) -> int:
        return 4 * self.budget // 21 if self.n_local is None else self.n_local

    @property
    def top_k(self) -> int:
        return self.budget - self.init - self.local

    @property
    def _key(self) -> tuple:  # the layer's cached selection of this configuration (layer.derived)
        return ("token_select", self.budget, self.init, self.local, self.temperature, self.pool_kernel,
                self.reuse_threshold)

    def select(self, ctx: Context):
        layer = ctx.layer
        real = layer.key_valid()  # [B, Hkv, T]
        fixed = sinks_and_window(real, self.init, max(self.local, ctx.q_len))
        candidates = real & ~fixed
        fingerprint = ctx.query.float().mean(2)  # [B, Hq, D]
        cache = layer.derived.get(self._key)
        reuse = self._reusable(ctx, cache, fingerprint)
        if reuse is not None and bool(reuse.all()):
            top = cache.top
        else:
            top = self._vote(ctx, fingerprint, candidates)
            if reuse is not None:  # rows that may reuse keep their previous selection (and its query)
                top = torch.where(reuse[:, None], cache.top, top)
                fingerprint = torch.where(reuse[:, None, None], cache.fingerprint, fingerprint)
            layer.derived[self._key] = _SelectionCache(fingerprint, top)
        chosen = fixed.clone()
        chosen.scatter_(-1, top[:, None].expand(-1, real.shape[1], -1), True)
        chosen = (chosen & real) | (real.sum(-1, keepdim=True) <= self.budget) & real  # a short row reads all
        return slots_of(chosen)

    def _vote(self, ctx: Context, fingerprint: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[B, top_k] the slots with the highest summed per-head softmax of f_h . k over the candidates."""
        keys = ctx.keys.float()  # [B, Hkv, T, D]
        batch, hkv = keys.shape[:2]
        f = fingerprint.view(batch, hkv, -1, keys.shape[-1])  # each KV head's GQA group of query heads
        logits = torch.einsum("bhgd,bhtd->bhgt", f, keys) / self.temperature
        logits = logits.masked_fill(~candidates[:, :, None], float("-inf"))
        votes = logits.softmax(-1).nan_to_num(0.0).sum((1, 2))  # a head with no candidate gives no vote
        votes = ctx.shards.sum(votes)  # [B, T], every query head of the model
        if self.pool_kernel > 1:
            votes = F.max_pool1d(votes[:, None], self.pool_kernel, 1, self.pool_kernel // 2)[:, 0]
        votes = votes.masked_fill(~candidates.any(1), float("-inf"))
        return votes.argsort(dim=-1, descending=True, stable=True)[..., :self.top_k]  # ties: the older slot

    def _reusable(self, ctx: Context, cache, fingerprint: torch.Tensor) -> torch.Tensor | None:
        """[B] rows whose query is close enough to the one that made the cached selection, or None (no cache)."""
        if cache is None or not cache.usable or cache.fingerprint.shape != fingerprint.shape or \
                cache.top.shape[-1] != min(self.top_k, ctx.layer.view_width):  # (a short layer's top_k grows)
            return None
        dot = ctx.shards.sum((fingerprint * cache.fingerprint).sum((1, 2)))
        norms = ctx.shards.sum(fingerprint.square().sum((1, 2))) * ctx.shards.sum(cache.fingerprint.square().sum((1, 2)))
        return dot >= self.reuse_threshold * norms.sqrt()


class _SelectionCache(DerivedState):
    """A layer's last selection (layer.derived): the query that made it [B, Hq, D] and its top_k slots [B, k]. A
    rollback that removes a slot it names makes it unusable (the next step selects anew); one that removes only newer
    slots (a speculative round's rejected drafts, inside the local window) leaves it as it is."""

    def __init__(self, fingerprint: torch.Tensor, top: torch.Tensor):
        self.fingerprint, self.top, self.usable = fingerprint, top, True

    def truncate(self, n_slots: int) -> None:
        if self.top.numel() and int(self.top.max()) >= n_slots:
            self.usable = False

