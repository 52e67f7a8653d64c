"""What every read kernel shares: the query side of one attention call (`Queries`), and the online-softmax
state (running max, running sum, accumulator) that kernels return, so a layer made of several storage segments
folds them into one softmax (flash-decoding style)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores import allowed_mask

State = tuple  # (m [B, Hkv, g, r], l [B, Hkv, g, r], acc [B, Hkv, g, r, D]), fp32


@dataclass(frozen=True)
class Queries:
    """The query rows of one attention call and how they read the cache."""

    values: torch.Tensor  # [B, Hq, r, D] post-RoPE
    positions: torch.Tensor  # [r] raw positions of the rows (shared by every batch row)
    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None

    def grouped(self, kv_heads: int) -> torch.Tensor:
        """fp32 [B, Hkv, g, r, D]: query heads grouped under their KV head (GQA, never repeating keys)."""
        batch, hq, rows, dim = self.values.shape
        return self.values.reshape(batch, kv_heads, hq // kv_heads, rows, dim).float()

    def allowed(self, key_positions: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Hkv, r, T] may each row read each slot (causal by original position, real slots, window)."""
        return allowed_mask(self.positions, key_positions, key_valid, self.sliding_window)

    def allowed_by_row(self, key_positions: torch.Tensor, key_valid: torch.Tensor | None, group: int) -> torch.Tensor:
        """`allowed` for every query row of each KV head's GQA group, [B, Hkv, g * r, T] (head-major, as the kernels
        lay the group's rows out)."""
        return self.allowed(key_positions, key_valid)[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)

    def kernel_mask(self, key_positions: torch.Tensor, key_valid: torch.Tensor | None, group: int):
        """allowed_by_row as the C kernels take it (uint8, contiguous); None where every row may read every slot."""
        if self.reads_every_slot(key_valid):
            return None
        return self.allowed_by_row(key_positions, key_valid, group).to(torch.uint8).contiguous()

    def reads_every_slot(self, key_valid: torch.Tensor | None) -> bool:
        """Whether `allowed` would be all True over slots whose validity is `key_valid` (None: all real): one query
        row (a decode step, whose token was just appended, so every stored position is <= its own), no invalid
        slot, no sliding window."""
        return self.values.shape[2] == 1 and key_valid is None and self.sliding_window is None

    def rows(self, start: int, end: int) -> "Queries":
        return Queries(self.values[:, :, start:end], self.positions[start:end], self.scaling, self.softcap,
                       self.sliding_window)


def empty_state(query_grouped: torch.Tensor) -> State:
    """(running max, running sum, accumulator) for query rows [B, Hkv, g, r, D]."""
    m = torch.full(query_grouped.shape[:-1], float("-inf"), device=query_grouped.device)
    return m, torch.zeros_like(m), torch.zeros_like(query_grouped, dtype=torch.float32)


def block_update(state: State, q, keys, values, scaling, softcap, allowed) -> State:
    """One block. q [B,Hkv,g,r,D] fp32; keys/values [B,Hkv,n,D] fp32; allowed [B,Hkv,r,n]."""
    m, l, acc = state
    batch, heads, group, rows, dim = q.shape
    # the GQA group's rows as one matrix per KV head (einsum computes the same, with more overhead per call)
    logits = (q.reshape(batch, heads, group * rows, dim) @ keys.transpose(-1, -2)).view(
        batch, heads, group, rows, -1) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    m_new = torch.maximum(m, logits.amax(-1))
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    p = torch.exp(logits - safe[..., None])
    correction = torch.exp(m - safe)
    l = l * correction + p.sum(-1)
    acc = acc * correction[..., None] + (p.reshape(batch, heads, group * rows, -1) @ values).view(acc.shape)
    return m_new, l, acc


def merge_states(a: State, b: State) -> State:
    """One state from two over disjoint slot sets (exact when either is empty)."""
    m = torch.maximum(a[0], b[0])
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(a[0] - safe), torch.exp(b[0] - safe)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def merge_splits(m_part, l_part, acc_part, shape, dim) -> State:
    """Merge per-split partials [BH, S, M(, D)] of a split-K kernel into one state shaped `shape` (+ D)."""
    rows = shape[-1] * shape[-2]
    m = m_part.amax(1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(m_part - safe[:, None])
    l = (l_part * w).sum(1)
    acc = (acc_part * w[..., None]).sum(1)
    return m[:, :rows].reshape(shape), l[:, :rows].reshape(shape), acc[:, :rows].reshape(*shape, dim)


def by_row_blocks(queries: Queries, rows_per_call: int, state_of) -> State:
    """state_of(queries) over blocks of at most `rows_per_call` query rows, the blocks' states joined along the
    rows: for kernels that hold every row of a GQA group in one program (their accumulator grows with the rows)."""
    rows = queries.values.shape[2]
    parts = [state_of(queries.rows(start, start + rows_per_call)) for start in range(0, rows, rows_per_call)]
    return parts[0] if len(parts) == 1 else tuple(torch.cat(ts, 3) for ts in zip(*parts))


def finish(state: State, queries: Queries) -> torch.Tensor:
    """The normalised output [B, Hq, r, D] in the query's dtype."""
    _, l, acc = state
    batch, hq, rows, dim = queries.values.shape
    return (acc / l[..., None]).reshape(batch, hq, rows, dim).to(queries.values.dtype)


def dense_attention_state(queries: Queries, keys, values, positions, valid=None, state: State | None = None) -> State:
    """Rectangular full-precision slots [B, Hkv, T, D] with their positions [B, Hkv, T] and validity."""
    q = queries.grouped(keys.shape[1])
    state = empty_state(q) if state is None else state
    if keys.shape[2] == 0:
        return state
    return block_update(state, q, keys.float(), values.float(), queries.scaling, queries.softcap,
                        queries.allowed(positions, valid))
