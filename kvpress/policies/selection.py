"""Selection: the one place where scores become kept slots, and the slot masks policies protect.

  by position   first_slots, last_slots, position_rank: the oldest / newest slots of each row and KV head;
                cache_local_keys: keys re-rotated to contiguous positions behind the newest (StreamingLLM, FreqKV)
  by score      select_kept (top-n per row and head, protected first), keep_best (and the in-place eviction of
                one slot per head), evict_to_budget (a layer under a budget and an allocation)
  after prompt  evict_after_prompt: every layer at once, once the whole prompt went through the model
  chunks        chunk_share: a chunked prefill's share of the budget, and the slots kept from earlier chunks
Every function takes the cache layer and changes it only through its public eviction calls (keep, replace_newest).
"""

from __future__ import annotations

import math

import torch

from ..heads import SINGLE, HeadShards
from ..positions import rotate_keys
from .allocation import adaptive_head_budgets, comparable, global_budgets
from .protocol import ModelPass


def first_slots(layer, n: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
    """Mask [B, Hkv, T] of the `n` [B, Hkv] earliest (by original position) slots of each row/head among
    `among` (default: the real slots)."""
    return _by_position(layer, n, among, newest=False)


def last_slots(layer, n: torch.Tensor, among: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mask [B, Hkv, T] of the `n` [B, Hkv] newest slots of each row/head among `among` (default: real slots).
    `positions`: of the slots `among` covers when that is not the whole view (a part from a segment boundary)."""
    return _by_position(layer, n, among, newest=True, positions=positions)


def position_rank(layer, among: torch.Tensor | None = None, newest_first: bool = False,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, T] rank of each slot among its row/head's `among` slots (default: the real ones) by original
    position, 0 = the oldest (the newest with newest_first); slots outside `among` rank after all of them."""
    among = layer.key_valid() if among is None else among
    if layer.sorted:  # slot order is position order: a running count says it
        counts = among.flip(-1).cumsum(-1).flip(-1) if newest_first else among.cumsum(-1)
        return torch.where(among, counts - 1, among.shape[-1])
    # slots evicted in place no longer follow position order: rank them by position
    positions = (layer.key_positions() if positions is None else positions).long()
    far = torch.iinfo(torch.long).min if newest_first else torch.iinfo(torch.long).max
    order = positions.masked_fill(~among, far).argsort(dim=-1, descending=newest_first, stable=True)
    return order.argsort(-1)


def cache_local_keys(layer, keys: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The layer's keys [B, Hkv, T, D] (over its padded view) re-rotated so that each row's real slots sit at
    contiguous positions ending at its newest one (the paper's cache-local positions, relative to the query): the
    slot of rank r among n moves to (newest position) - (n - 1 - r). Rotating the stored keys once per read, by
    their offset, accumulates no rounding error."""
    valid = layer.key_valid()
    positions = layer.key_positions().long()
    rank = position_rank(layer, valid)
    n_valid = valid.sum(-1, keepdim=True)
    newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)
    delta = (newest - (n_valid - 1 - rank)) - positions
    return rotate_keys(keys, delta.masked_fill(~valid, 0), inv_freq)


def _by_position(layer, n, among, newest, positions=None):
    among = layer.key_valid() if among is None else among
    if not layer.sorted and n.numel() and bool((n == n.flatten()[0]).all()):
        k = min(int(n.flatten()[0]), among.shape[-1])  # the same count everywhere: one top-k by position
        positions = layer.key_positions() if positions is None else positions
        if newest:
            # A recent window (H2O) is never evicted, so its k positions are normally all still there: the slots
            # within k of each head's newest position are then exactly the k newest (k distinct positions in a
            # range of k). Checked by counting; otherwise the top-k below decides.
            top = positions.masked_fill(~among, -1).amax(-1, keepdim=True)
            window = among & (positions > top - k)
            if bool((window.sum(-1) == among.sum(-1).clamp(max=k)).all()):
                return window
        far = torch.iinfo(torch.long).min if newest else torch.iinfo(torch.long).max
        key = positions.long().masked_fill(~among, far)
        chosen = torch.zeros_like(among).scatter_(-1, key.topk(k, dim=-1, largest=newest).indices, True)
        return among & chosen
    return among & (position_rank(layer, among, newest_first=newest, positions=positions) < n[..., None])


def select_kept(
    scores: torch.Tensor, valid: torch.Tensor, n_keep: torch.Tensor, protected: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`n_keep` [B, Hkv] real slots per row/head by score, protected slots first.

    Returns (indices [B, Hkv, T'], keep_valid [B, Hkv, T']) with T' = max n_keep: storage stays
    rectangular, and rows/heads that keep fewer tokens mark the extra slots invalid (never attended)."""
    s = comparable(scores)
    if protected is not None:
        s = s.masked_fill(protected & valid, math.inf)
    s = s.masked_fill(~valid, -math.inf)
    width = int(n_keep.max())
    # A stable sort, not topk: ties (max-pooling makes plateaus) then always go to the earlier slot, so a
    # left-padded row picks exactly what the same prompt picks alone.
    indices = s.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    keep_valid = torch.arange(width, device=s.device) < n_keep[..., None]
    return indices, keep_valid


def evict_to_budget(layer, scores: torch.Tensor, budget: torch.Tensor, kept_first=None,
                    allocation: str = "uniform", head_floor: float = 0.0, shards: HeadShards = SINGLE,
                    observers: int = 0) -> None:
    """Keep the best `budget` [B] slots per row and KV head of `layer` by `scores` [B, Hkv, T]: real slots only,
    `kept_first(n_keep)` ([B, Hkv, T] or None) before any other; 'adaptive' allocation spreads each row's total
    over its heads (allocation.py); the newest `observers` tokens (observation queries) are never kept. The one
    place where scores become a keep()."""
    valid = layer.key_valid()
    if observers:
        valid = valid & (layer.key_positions() < layer.seen - observers)
    n_valid = valid.sum(-1)  # [B, Hkv]
    n_keep = torch.minimum(budget[:, None].to(n_valid), n_valid)
    if bool((n_keep == n_valid).all()) and layer.view_width == int(n_keep.max()):
        return  # within budget and already rectangular: nothing to free
    protected = None if kept_first is None else kept_first(n_keep)
    if allocation == "adaptive":  # one top-k over the layer's heads: every rank's (tensor parallelism)
        n_keep, scores = adaptive_head_budgets(shards.gather(scores), shards.gather(valid), shards.gather(n_keep),
                                               shards.gather(protected), head_floor)
        n_keep, scores = shards.local(n_keep), shards.local(scores)
        protected = None  # folded into the priorities
    keep_best(layer, scores, valid, n_keep, protected, n_valid)


def keep_best(layer, scores: torch.Tensor, valid: torch.Tensor, n_keep: torch.Tensor,
              protected: torch.Tensor | None = None, n_valid: torch.Tensor | None = None, offset: int = 0) -> bool:
    """Keep the best `n_keep` [B, Hkv] real slots of each row/head, protected ones first (select_kept). When every
    head has exactly one slot too many (a decode step of a policy that holds its budget), the one it drops is
    evicted in place (layer.replace_newest: the new token takes its slot), not by copying the layer.
    With `offset` > 0 the tensors cover the view's slots from `offset` on (the others stay) and only the in-place
    eviction is tried: returns whether it was done (always True for offset 0)."""
    n_valid = valid.sum(-1) if n_valid is None else n_valid
    if bool(((n_valid - n_keep) == 1).all()):
        s = comparable(scores).masked_fill(~valid, math.inf)
        if protected is not None:
            s = s.masked_fill(protected & valid, math.inf)
        # the lowest score; among ties the latest slot, the one select_kept's stable sort would drop
        victims = s.shape[-1] - 1 - s.flip(-1).argmin(-1)
        if layer.replace_newest(victims + offset):
            return True
    if offset:
        return False
    layer.keep(*select_kept(scores, valid, n_keep, protected))
    return True


def evict_after_prompt(run: ModelPass, scores: dict, allocation: str, head_floor: float = 0.0) -> None:
    """The model-level counterpart of evict_to_budget, for policies that score once the whole prompt went through
    every layer (KVzip, KVzap): keep the best slots of every layer by `scores` {layer_idx: [B, Hkv, T]} under each
    layer's row budget. 'global' runs one top-k over every (layer, KV head, slot) of a row, so layers and heads
    keep different counts (stored flat); the other allocations cut each layer alone. In a chunked prefill, slots
    kept from earlier chunks stay and this chunk adds its share."""
    layers = run.layers()
    budgets, earlier = {}, {}
    for i, layer in layers:
        if run.prompt_tokens is None:
            budgets[i], earlier[i] = layer.row_budget, None
        else:
            budgets[i], earlier[i] = chunk_share(layer, run.prompt_tokens, run.prompt_length, layer.last_q_len)
    if allocation != "global":
        for i, layer in layers:
            evict_to_budget(layer, scores[i], budgets[i], lambda n, e=earlier[i]: e, allocation, head_floor,
                            run.shards)
        return
    valid = {i: layer.key_valid() for i, layer in layers}
    # one top-k over every layer and head of the model: under tensor parallelism, every rank's heads (one
    # all-gather per layer), each rank then keeps its own block
    shards = run.shards
    heads = {i: valid[i].shape[1] * shards.count for i, _ in layers}
    total = sum(budgets[i] * heads[i] for i, _ in layers)  # [B] tokens a row keeps over all layers and heads
    counts, priorities = global_budgets([shards.gather(scores[i]) for i, _ in layers],
                                        [shards.gather(valid[i]) for i, _ in layers],
                                        [shards.gather(earlier[i]) for i, _ in layers], total)
    counts, priorities = [shards.local(c) for c in counts], [shards.local(p) for p in priorities]
    for (i, layer), n_keep, priority in zip(layers, counts, priorities):
        if bool((n_keep == valid[i].sum(-1)).all()) and layer.view_width == int(n_keep.max()):
            continue
        layer.keep(*select_kept(priority, valid[i], n_keep))




def chunk_share(layer, prompt_tokens: torch.Tensor, prompt_length: int, q_len: int, observers: int = 0,
                window: int = 0):
    """Chunked prefill: (budget [B] a row may hold after this chunk, [B, Hkv, T] slots kept from earlier chunks).

    Tokens kept from earlier chunks stay, and this chunk adds its share of the budget, so after a chunk a row holds
    budget x (its real tokens seen / its prompt's real tokens). Re-judging earlier survivors by each later chunk's
    queries would favour recent tokens chunk after chunk (an early needle at 8K is lost that way at 75% on
    SmolLM2, but kept this way). The forward's last `observers` tokens (a known question appended to the chunk)
    are not prompt tokens: they vote, and are never kept. A chunk holding fewer of a row's tokens than the policy's
    always-kept `window` (the first chunk takes the remainder of the prompt, which can be a few tokens) is kept
    whole, unless the row's prompt ends there: its share would be all window, and the window its newest tokens, so
    the chunk would lose its first ones, the attention sink among them (SnapKV 0.3 on SmolLM2, a 15-token first
    chunk: position 0 gone in every head, the answer broken)."""
    real_seen = (prompt_tokens - (prompt_length - (layer.seen - observers))).clamp(min=0)
    share = torch.ceil(layer.row_budget * real_seen / prompt_tokens.clamp(min=1)).long()
    if window:
        real_before = (prompt_tokens - (prompt_length - (layer.seen - q_len))).clamp(min=0)
        short = (real_seen - real_before < window) & (real_seen < prompt_tokens)
        share = torch.where(short, torch.iinfo(torch.long).max, share)  # evict_to_budget keeps every real token
    earlier = layer.key_valid() & (layer.key_positions() < layer.seen - q_len)
    return share, earlier
