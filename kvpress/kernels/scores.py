"""Attention scores for policies (torch reference; used on every device for now).

Masking is defined once, in `allowed_mask`: a query at raw position p may read a stored slot when the slot
is a real token, its original position is <= p, and (for sliding-window layers) > p - window.
GQA is handled by grouping query heads under their KV head, never by repeating keys.
"""

from __future__ import annotations

import torch

# Upper bound on fp32 elements of one logits block when summing attention column-wise (4 MB): blocks that stay
# in cache run the five passes of the in-place softmax about 2x faster on CPU than 64 MB blocks (measured).
_BLOCK_ELEMENTS = 1 << 20


def allowed_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[B, Hkv, q, T] bool: may query row i (raw position query_positions[i]) read stored slot t. query_positions:
    [q], one for every row of the batch, or [B, q], each row's own (rows that query at different positions)."""
    q = query_positions.reshape(-1 if query_positions.dim() == 2 else 1, 1, query_positions.shape[-1], 1)
    k = key_positions[:, :, None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (k > q - sliding_window)
    if key_valid is not None:
        allowed = allowed & key_valid[:, :, None, :]
    # A row with nothing to read (a padding query) may read itself, so softmax never sees an all -inf row.
    return allowed | (k == q)


def masked_softmax_(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """In-place softmax of fp32 logits [B, Hkv, g, r, T] over allowed slots [B, Hkv, r, T] (these blocks are
    the largest temporaries a policy creates)."""
    logits.masked_fill_(~allowed[:, :, None], float("-inf"))
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True))


def attention_probs(
    key_logits,
    query: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Softmax attention [B, Hq, r, T] (fp32) of `query` rows [B, Hq, r, D] (at query_positions, as allowed_mask
    takes them) over the stored slots.
    `key_logits(query, upto)` returns fp32 logits [B, Hkv, g, r, upto] (scaled, soft-capped)."""
    batch, hq, rows, _ = query.shape
    logits = key_logits(query, key_positions.shape[-1])
    allowed = allowed_mask(query_positions, key_positions, key_valid, sliding_window)
    return masked_softmax_(logits, allowed).reshape(batch, hq, rows, -1)


def attention_column_sums(
    key_logits,
    query: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    sliding_window: int | None = None,
    perturb=None,
) -> torch.Tensor:
    """Attention each slot receives, summed over the real query rows: [B, Hq, T] (fp32), computed in
    query-row chunks so memory is O(chunk x T) rather than O(q x T). `perturb(logits, rows, upto)`, if given,
    rewrites each block of fp32 logits [B, Hkv, g, r, upto] of query rows `rows` (a slice) in place before the
    mask and the softmax (Keyformer's Gumbel noise and temperature)."""
    batch, hq, rows, _ = query.shape
    length = key_positions.shape[-1]
    chunk = max(1, min(rows, _BLOCK_ELEMENTS // max(1, batch * hq * length)))
    # Padding query rows attend only to themselves (see allowed_mask); they must not vote.
    if key_valid is None:
        query_real = None
    else:
        by_pos = torch.zeros(batch, int(key_positions.max()) + 1, dtype=torch.bool, device=key_positions.device)
        by_pos.scatter_(1, key_positions[:, 0].long().clamp(min=0), key_valid[:, 0])
        query_real = by_pos[:, query_positions]  # [B, rows]
    total = torch.zeros(batch, hq, length, dtype=torch.float32, device=key_positions.device)
    for start in range(0, rows, chunk):
        sl = slice(start, min(rows, start + chunk))
        positions = query_positions[sl]
        # Slots are sorted by position in every head, so those a chunk can reach (position <= its last query)
        # form a prefix: skip the causally masked rest (about half the work over a prompt). Without padding or
        # a sliding window, every query of the chunk reads the slots up to its first position: mask only after.
        reach = int((key_positions <= positions[-1]).sum(-1).max())
        open_ = 0 if key_valid is not None or sliding_window is not None else \
            int((key_positions <= positions[0]).sum(-1).min())
        logits = key_logits(query[:, :, sl], reach)  # [B, Hkv, g, r, reach]
        if perturb is not None:
            perturb(logits, sl, reach)
        if open_ < reach:
            allowed = allowed_mask(positions, key_positions[..., open_:reach],
                                   None if key_valid is None else key_valid[..., open_:reach], sliding_window)
            logits[..., open_:].masked_fill_(~allowed[:, :, None], float("-inf"))
        exp = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        # Column sums of the softmax = (1 / row sums) @ exp: one matrix product instead of normalising every
        # element and then summing.
        weight = exp.sum(-1).reciprocal_()  # [B, Hkv, g, r]
        if query_real is not None:
            weight = weight * query_real[:, None, None, sl]
        total[..., :reach] += (weight[..., None, :] @ exp).reshape(batch, hq, reach)
    return total
