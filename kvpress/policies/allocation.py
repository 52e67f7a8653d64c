"""Budget allocation: how a scorer policy's budget is spread over layers and heads (generic, any scorer).

uniform   every layer and KV head keeps the same budget (the default).
pyramid   PyramidKV (Cai et al. 2024): lower layers keep more, higher layers fewer, on a linear ramp (the top
          layer keeps (C - w) / beta + w for a mean budget C and window w); the sum over layers equals uniform's.
adaptive  AdaKV (Feng et al. 2024): inside a layer, one top-k over the scores of all its KV heads picks the
          layer's total, so heads whose attention is spread out keep more; each head first keeps its own
          top `floor` x (mean per-head budget), the safeguard against starving a head.
"""

from __future__ import annotations

import math

import torch

ALLOCATIONS = ("uniform", "pyramid", "adaptive", "global")


def validate_allocation(owner: str, allocation, floor, beta, allowed=ALLOCATIONS) -> None:
    if allocation not in allowed:
        raise ValueError(f"{owner}: budget_allocation={allocation!r} is not one of this policy's allocations; "
                         f"allowed values: {list(allowed)}")
    if not 0.0 <= float(floor) <= 1.0:
        raise ValueError(
            f"{owner}: head_floor={floor!r} is a fraction of the mean per-head budget; a floor above the mean "
            f"budget cannot be met by every head; allowed values: a float in [0, 1]")
    if float(beta) <= 1.0:
        raise ValueError(f"{owner}: pyramid_beta={beta!r}; allowed values: a number > 1")


def whole_pages(budget: torch.Tensor, n_real: torch.Tensor, page_size: int) -> torch.Tensor:
    """The budget [B] a paged engine keeps: raised (by fewer than `page_size` tokens) until the tokens it evicts
    from each row's `n_real` prompt tokens fill whole pages, so every evicted page can go back to the pool. A
    budget at or above the prompt keeps it all (and stays the budget while decoding). page_size 1 (no pages)
    leaves the budget as it is."""
    if page_size == 1:
        return budget
    evicted = (n_real - budget).clamp(min=0) // page_size * page_size
    return torch.maximum(budget.to(n_real.dtype), n_real - evicted)  # (a prompt under its budget: the budget stays)


def pyramid_budgets(mean_budget: torch.Tensor, n_real: torch.Tensor, n_layers: int, window: int,
                    beta: float) -> torch.Tensor:
    """[n_layers, B] tokens per KV head in each layer; per row the sum over layers is n_layers * mean_budget.

    PyramidKV's ramp (KVCache-Factory's PyramidKVCluster): with C the mean per-layer budget and w the window
    kept apart, the selected part runs from max = 2(C-w) - min at layer 0 down to min = (C-w)/beta at the top;
    max is clipped to the prompt (L - w) and min recomputed so the total holds. Rounded so sums stay exact."""
    rows = []
    for c, length in zip(mean_budget.tolist(), n_real.tolist()):
        base = c - window
        if n_layers == 1 or base <= 0 or length <= c:
            rows.append([float(c)] * n_layers)
            continue
        low = max(base / beta, 1.0)  # every layer keeps at least one selected token
        high = 2 * base - low
        if high > length - window:
            high = length - window
            low = 2 * base - high
        step = (high - low) / (n_layers - 1)
        rows.append([high - i * step + window for i in range(n_layers)])
    exact = torch.tensor(rows, dtype=torch.float64).T  # [n_layers, B]
    budgets = exact.floor()
    # hand the rounding remainder to the layers that lost the largest fractions, so each row sums exactly
    short = (mean_budget.double() * n_layers - budgets.sum(0)).round().long()
    order = (exact - budgets).argsort(dim=0, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(n_layers)[:, None].expand_as(order))
    budgets += (rank < short[None, :]).double()
    return budgets.long().clamp(min=1).to(mean_budget.device)


def comparable(scores: torch.Tensor) -> torch.Tensor:
    """Scores in the precision they are ranked in: half precision goes up to float32, float64 stays (kvzap lifts
    its protected window by a constant that float32 would round its predicted order away under)."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def adaptive_head_budgets(scores: torch.Tensor, valid: torch.Tensor, n_keep: torch.Tensor,
                          protected: torch.Tensor | None, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV: ([B, Hkv] tokens each head keeps, [B, Hkv, T] priorities to pick them by), so that a row keeps
    n_keep.sum(heads) in all (the uniform total) and each head's pick is exactly its share of the layer top-k.

    Protected slots and each head's top floor*n_keep (NVIDIA kvpress's exact-total form of AdaKV's
    round(n(1-a) + a*B) safeguard) are taken first; one top-k over every head's remaining scores fills the
    rest of the layer's total."""
    s = comparable(scores).masked_fill(~valid, -math.inf)
    if protected is not None:
        s = s.masked_fill(protected & valid, math.inf)
    n_floor = torch.floor(n_keep.double() * floor).long()
    # rank inside each head, protected first; the floor slots become protected too
    rank = s.argsort(dim=-1, descending=True, stable=True).argsort(-1)
    s = s.masked_fill((rank < n_floor[..., None]) & valid, math.inf)
    batch, heads, width = s.shape
    total = n_keep.sum(-1)  # [B]
    flat_rank = s.reshape(batch, -1).argsort(dim=-1, descending=True, stable=True).argsort(-1)
    chosen = (flat_rank < total[:, None]).reshape(batch, heads, width) & valid
    return chosen.sum(-1), s


def global_budgets(scores: list, valid: list, kept_first: list, total: torch.Tensor) -> tuple[list, list]:
    """One top-k over every (layer, KV head, slot) of a row (KVzip's non-uniform allocation): per layer, ([B, Hkv]
    tokens each head keeps, [B, Hkv, T] priorities to pick them by), so that row b keeps total[b] tokens over all
    layers and heads. `kept_first` (per layer [B, Hkv, T] or None) are taken before any other."""
    flat = []
    for s, ok, first in zip(scores, valid, kept_first):
        s = comparable(s).masked_fill(~ok, -math.inf)
        if first is not None:
            s = s.masked_fill(first & ok, math.inf)
        flat.append(s.flatten(1))
    sizes = [f.shape[1] for f in flat]
    joined = torch.cat(flat, 1)  # [B, sum of Hkv x T]
    # a stable sort: ties go to the earlier (layer, head, slot), the same with or without left padding
    rank = joined.argsort(dim=-1, descending=True, stable=True).argsort(-1)
    chosen = (rank < total[:, None]) & (joined > -math.inf)
    counts, priorities = [], []
    for part, s, ok in zip(chosen.split(sizes, 1), scores, valid):
        part = part.view_as(ok) & ok
        counts.append(part.sum(-1))
        priorities.append(torch.where(part, math.inf, -math.inf))
    return counts, priorities
